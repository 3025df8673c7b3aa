"""What one sampling run did: its counters, logged reasons, timers and report (`RunTracker`).

`RunTracker` holds everything that belongs to one run (its sigmas, reasons already logged,
counters, timings, the plans kept between its steps) and is reset when the next run starts, so
nothing grows across runs; the kept plans also go when the run's schedule reaches its end.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from ..backend.plan_reuse import PlanStore
from ..notices import Notices, logger
from .error_meter import ErrorMeter
from .error_target import ErrorTarget
from .schedule import denoising_step

log = logger()
MAX_SUMMARIES = 8  # measured sparse choices named in one run's report (a run uses one or two shape classes)


@dataclass
class RunStats:
    """Counters of one sampling run."""

    dense_steps: set[int] = field(default_factory=set)
    sparse_steps: set[int] = field(default_factory=set)
    dense_blocks: int = 0
    sparse_blocks: int = 0
    density_sum: float = 0.0  # over sparse block calls
    attention_ms: float = 0.0  # our attention in sparse blocks
    layers: dict[int, list[int]] = field(default_factory=dict)  # layer -> [dense calls, sparse calls]
    dense_reasons: dict[str, int] = field(default_factory=dict)  # why block calls ran dense -> count
    timed_sparse_ms: float = 0.0  # calls timed against dense attention (one per shape and run)
    timed_dense_ms: float = 0.0
    dense_kernels: dict[str, int] = field(default_factory=dict)  # kernel of our dense override -> calls
    sparse_kernels: dict[str, int] = field(default_factory=dict)  # sparse attention kernel -> calls
    sparse_choices: list[str] = field(default_factory=list)  # the measured sparse choices' summaries used
    notes: list[str] = field(default_factory=list)  # what the run's report says besides its counters
    errors: ErrorMeter = field(default_factory=ErrorMeter)  # the sparse calls' sampled error, on the device
    target: ErrorTarget = field(default_factory=ErrorTarget)  # the blocks' ratios under error_target


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
        self.plans = PlanStore()  # plans kept between evaluated steps (plan_reuse="on"), bounded, per run
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

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
                   reason: str | None = None) -> None:
        """Count one block call: sparse with its density, or dense with the reason why.

        Args:
            step: the call's denoising step (None when unknown: counted as step -1).
            sparse: whether the block ran sparse attention.
            density: its exact-pair density.
            layer: the block index, for the per-layer counts.
            reason: why a dense call ran dense, for the report.
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
            else:
                s.dense_blocks += 1
                s.dense_steps.add(key)

    def note_timing(self, key: tuple, sparse_ms: float, dense_ms: float) -> None:
        """Record one call timed against dense attention for layout signature `key`."""
        with self.lock:
            self.timed.add(key)
            self.stats.timed_sparse_ms += sparse_ms
            self.stats.timed_dense_ms += dense_ms

    def start_timer(self, x: torch.Tensor) -> object:
        """Start timing our attention; CUDA events avoid a host synchronisation per block."""
        if x.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def stop_timer(self, token: object) -> None:
        """Stop the timer `start_timer` returned; CUDA times are added up at the next `flush_timers`."""
        with self.lock:
            if isinstance(token, float):
                self.stats.attention_ms += (time.perf_counter() - token) * 1e3
                return
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((token, end))

    def flush_timers(self) -> None:
        """Add up recorded CUDA event pairs (called once per model call and at the end of a run)."""
        with self.lock:
            if self._pending:
                self._pending[-1][1].synchronize()
                self.stats.attention_ms += sum(a.elapsed_time(b) for a, b in self._pending)
                self._pending.clear()

    def mean_density(self) -> float:
        """Mean density of the sparse block calls (1.0 when none ran sparse)."""
        s = self.stats
        return s.density_sum / s.sparse_blocks if s.sparse_blocks else 1.0

    def summary(self) -> str | None:
        """One log line of the run's counters, or None when no block ran."""
        s = self.stats
        if not (s.dense_blocks or s.sparse_blocks):
            return None
        # a step is sparse when any block of it ran sparse
        sparse_steps = len(s.sparse_steps)
        dense_steps = len(s.dense_steps - s.sparse_steps)
        overall = (s.density_sum + s.dense_blocks) / (s.sparse_blocks + s.dense_blocks)
        density = f"{self.mean_density():.3f} in sparse blocks ({overall:.3f} over all blocks)"
        line = (f"{self.name}: steps {dense_steps} dense / {sparse_steps} sparse; blocks {s.dense_blocks} dense / "
                f"{s.sparse_blocks} sparse; mean density {density}; sparse attention time "
                f"{s.attention_ms / 1e3:.2f} s; precision {self.precision[0]}")
        if s.dense_kernels:
            line += "; dense attention on " + ", ".join(sorted(s.dense_kernels))
        if s.sparse_kernels:
            line += "; sparse attention on " + ", ".join(sorted(s.sparse_kernels))
        error = s.errors.summary()
        if error is not None:
            block, value = error["worst_block"]
            line += f"; measured error {error['mean']:.3f} (worst block {block}: {value:.3f})"
        plans = self.plans.summary()
        if plans["reused"]:
            past = plans.get("built: memory budget", 0)
            line += (f"; plans reused {plans['reused']}, built {plans['built']} ({plans['rebuilds']} rebuilds"
                     + (f", {past} past the plans' memory budget" if past else "") + ")")
        return line

    def report(self) -> dict:
        """What the run did, as plain data (the report node shows it).

        ``est_saved_s`` scales the sparse attention time by the dense/sparse time ratio of the calls
        timed against torch's dense attention (None when no call was timed); negative when sparse
        attention was slower.
        """
        s = self.stats
        attention_s = s.attention_ms / 1e3
        ratio = s.timed_dense_ms / s.timed_sparse_ms if s.timed_sparse_ms > 0 else None
        return {"steps_sparse": sorted(s.sparse_steps), "steps_dense": sorted(s.dense_steps - s.sparse_steps),
                "blocks_sparse": s.sparse_blocks, "blocks_dense": s.dense_blocks,
                "layers_sparse": sorted(i for i, (_, n) in s.layers.items() if n),
                "layers_dense_only": sorted(i for i, (_, n) in s.layers.items() if not n),
                "mean_density": self.mean_density(), "attention_s": attention_s,
                "est_saved_s": None if ratio is None else attention_s * (ratio - 1.0),
                "dense_reasons": dict(s.dense_reasons), "precision": self.precision[0],
                "precision_reason": self.precision[1], "dense_kernels": dict(s.dense_kernels),
                "sparse_kernels": dict(s.sparse_kernels), "sparse_choices": list(s.sparse_choices),
                "notes": list(s.notes), "plans": self.plans.summary(), "error": s.errors.summary()}

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
            self.stats = RunStats()
            return line
