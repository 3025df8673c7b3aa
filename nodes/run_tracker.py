"""What one sampling run did: its counters, logged reasons and timers (`RunTracker`); its report is made
from them by `run_report`.

`RunTracker` holds everything that belongs to one run (its sigmas, reasons already logged,
counters, timings, the plans kept between its steps) and is reset when the next run starts, so
nothing grows across runs; the kept plans also go when the run's schedule reaches its end.
"""
from __future__ import annotations

import logging
import threading

import torch

from ..backend.plan_reuse import PlanStore
from ..notices import Notices, logger
from .run_report import report_of, summary_line
from .run_stats import RunStats
from .run_timers import RunTimers, mark
from .schedule import denoising_step

log = logger()
MAX_SUMMARIES = 8  # measured sparse choices named in one run's report (a run uses one or two shape classes)


class RunTracker:
    """State of the current sampling run: its sigmas, logged reasons, statistics and timers.

    A run is one denoising schedule, over any number of sampler calls: a model call continues the
    run while its sigma is not above the previous call's (a CFG pair shares one sigma, a split
    schedule continues where the last sampler call stopped); a higher sigma (a new prompt, a
    rerun after an interrupt) starts a new run. A call's step is its place in the run's schedule:
    the sigmas of every sampler call of the run, merged (so split runs number their steps as the
    whole schedule does). Thread-safe: ComfyUI's multi-GPU sampling runs model calls in threads.
    """

    def __init__(self, name: str, parent: RunTracker | None = None):
        self.name = name
        self.parent = parent  # reports also go there (the tracker of the model this one was cloned from)
        self.lock = threading.RLock()
        self.run_sigmas: list[float] = []  # the run's schedule so far, descending
        self.last_sigma: float | None = None  # sigma of the run's latest model call
        self.summarised = False  # the run's summary was logged (its schedule reached sigma 0)
        self.at_end = False  # the latest call was the last step of a schedule that ends at sigma 0
        self.notices = Notices()  # reasons already logged this run
        self.stats = RunStats()
        self.densities: dict[tuple, float] = {}  # per layout signature, measured once per run
        self.last_report: dict | None = None  # `report()` of the latest run that ran any block, as of its last sampler call
        self.timed: set[tuple] = set()  # layout signatures already timed against dense this run
        self.precision: tuple[str, str] = ("bf16", "not resolved yet")  # (precision, why), set per sampler call
        self.plans = PlanStore()  # plans kept between evaluated steps (plan_reuse on, auto), bounded, per run
        self.branches: dict[tuple, int | None] = {}  # cond_or_uncond keys of the run's calls -> step first seen
        self.timers = RunTimers()  # CUDA events of the run not read yet

    def step_of(self, transformer_options: dict) -> tuple[int | None, float | None, tuple[int, int] | None]:
        """(step in the run, sigma, (step, total) in this sampler call's schedule) of a model call;
        a sigma above the previous call's starts a new run. All None without sigmas."""
        schedule = transformer_options.get("sample_sigmas")
        sigma = transformer_options.get("sigmas")
        if schedule is None or sigma is None:
            self.log_once("ComfyUI passed no sample_sigmas/sigmas: warmup cannot be applied, every call "
                          "counts as a sparse-eligible step")
            return None, None, None
        sched = schedule.detach().flatten().to("cpu", torch.float64)
        segment = denoising_step(sigma, sched)
        s = float(sigma.detach().flatten()[0])
        entry = float(sched[segment[0]])
        with self.lock:
            if self.last_sigma is not None and s > self.last_sigma:
                self.finish()
            self.last_sigma = s
            self.at_end = segment[0] == segment[1] - 1 and float(sched[-1]) == 0.0
            self.run_sigmas = sorted(set(self.run_sigmas) | set(sched.tolist()), reverse=True)
            self.flush_timers()
            return sum(v > entry for v in self.run_sigmas), s, segment

    def next_sigma(self, sigma: float | None) -> float | None:
        """The run's schedule's sigma after `sigma` (0.0 past its last step), None without one."""
        if sigma is None:
            return None
        with self.lock:
            return next((s for s in self.run_sigmas if s < sigma * (1.0 - 1e-6)), 0.0)

    def note_branch(self, branch: tuple, step: int | None) -> None:
        """A block call of `branch` (its ``cond_or_uncond`` key) at `step`: the branches the run has shown."""
        if branch not in self.branches:
            with self.lock:
                self.branches.setdefault(branch, step)

    def seen_branches(self) -> dict[tuple, int | None]:
        """A copy of the run's branch keys -> the step each was first seen at (`note_branch`)."""
        with self.lock:
            return dict(self.branches)

    def log_once(self, message: str, level: int = logging.WARNING) -> None:
        """Log a message (a warning by default) once per run (a reason that holds for every block is
        not repeated per block)."""
        self.notices.say(f"{self.name}: {message}", level)

    def say_in_report(self, message: str, level: int = logging.WARNING) -> None:
        """Log `message` (at `level`) once per run and keep it in the run's report."""
        with self.lock:
            if message in self.stats.notes:
                return
            self.stats.notes.append(message)
        self.log_once(message, level)

    def note_dense_kernel(self, name: str) -> None:
        """Count one attention call of our dense override on kernel `name`."""
        with self.lock:
            kernels = self.stats.dense_kernels
            kernels[name] = kernels.get(name, 0) + 1

    def note_sparse_kernel(self, label: str, summary: str) -> None:
        """Count one sparse attention call on the kernel named `label`, with its measured choice's
        `summary` ("" where nothing was measured)."""
        with self.lock:
            s = self.stats
            s.sparse_kernels[label] = s.sparse_kernels.get(label, 0) + 1
            if summary and summary not in s.sparse_choices and len(s.sparse_choices) < MAX_SUMMARIES:
                s.sparse_choices.append(summary)

    def note_block(self, step: int | None, sparse: bool, density: float = 1.0, layer: int | None = None,
                   reason: str | None = None, shape: tuple | None = None) -> None:
        """Count one block call: sparse with its density, or dense with the reason why.

        Args:
            step: the call's denoising step (None when unknown: counted as step -1).
            sparse: whether the block ran sparse attention.
            density: its exact-pair density.
            layer: the block index, for the per-layer counts.
            reason: why a dense call ran dense, for the report.
            shape: a sparse call's timing key (layout signature, ratio), for the saved time.
        """
        with self.lock:
            s = self.stats
            key = -1 if step is None else step
            if layer is not None:
                s.layers.setdefault(layer, [0, 0])[int(sparse)] += 1
            if not sparse and reason is not None:
                s.dense_reasons[reason] = s.dense_reasons.get(reason, 0) + 1
            if sparse:
                s.sparse_blocks += 1
                s.sparse_steps.add(key)
                s.density_sum += density
                if shape is not None:
                    s.shape_calls[shape] = s.shape_calls.get(shape, 0) + 1
            else:
                s.dense_blocks += 1
                s.dense_steps.add(key)

    def note_timing(self, key: tuple, share: float, baseline: str, marks: tuple[object, object, object]) -> None:
        """Record one head group of a sparse call timed against dense attention.

        Args:
            key: the call's timing key (layout signature, ratio).
            share: the head group's share of the call's heads.
            baseline: the dense attention timed, as the report names it.
            marks: `run_timers.mark`s before the sparse op, after it and after the dense attention (CUDA
                events are read at the next `flush_timers`).
        """
        with self.lock:
            self.timed.add(key)
            self.timers.timing(self.stats, key, share, baseline, marks)

    def start_timer(self, x: torch.Tensor) -> object:
        """Start timing our attention; CUDA events avoid a host synchronisation per block."""
        return mark(x)

    def stop_timer(self, token: object) -> None:
        """Stop the timer `start_timer` returned; CUDA times are added up at the next `flush_timers`."""
        with self.lock:
            self.timers.stop(self.stats, token)

    def flush_timers(self) -> None:
        """Add up recorded CUDA events (called once per model call and at the end of a run)."""
        with self.lock:
            self.timers.flush(self.stats)

    def summary(self) -> str | None:
        """The run's log line (`run_report.summary_line`), or None when no block ran."""
        return summary_line(self.name, self.stats, self.precision[0], self.plans.summary())

    def report(self) -> dict:
        """What the run did, as plain data (`run_report.report_of`)."""
        return report_of(self.stats, self.precision, self.plans.summary())

    def publish(self) -> None:
        """Keep the run's report (when any block ran) here and in the parents' trackers."""
        if self.stats.dense_blocks or self.stats.sparse_blocks:
            report, tracker = self.report(), self
            while tracker is not None:
                tracker.last_report = report
                tracker = tracker.parent

    def end_call(self) -> str | None:
        """End of a sampler call: keep the report of the run so far; when it ran the last step of a
        schedule that ends at sigma 0, log the run's summary (once). Returns the line logged, if any."""
        with self.lock:
            self.flush_timers()
            self.publish()
            if self.summarised or not self.at_end:
                return None
            self.summarised = True
            line = self.summary()
            if line:
                log.info("%s", line)
            self.plans.drop_plans()  # the run's schedule ended: its kept plans go (the counts stay for the report)
            return line

    def finish(self) -> str | None:
        """End the run: log its summary (unless `end_call` did), keep its report and reset everything
        it held. Returns the summary line."""
        with self.lock:
            self.flush_timers()
            line = self.summary()
            if line and not self.summarised:
                log.info("%s", line)
            self.publish()
            self.run_sigmas, self.last_sigma, self.at_end, self.summarised = [], None, False, False
            self.notices.clear()
            self.densities.clear()
            self.timed.clear()
            self.plans.clear()
            self.branches.clear()
            self.stats = RunStats()
            return line
