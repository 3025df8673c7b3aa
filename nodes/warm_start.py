"""Compile a run's sparse kernels in a child process while its dense warmup steps run.

The Triton kernels are plain ``@triton.jit`` functions with fixed launch configurations (no
autotuning, `kernels/triton/configs.py`): a process that launches one compiles it once per
specialisation (its constexprs, dtypes and the alignment of the arguments it specialises) and
writes it to Triton's disk cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``); another process
launching the same kernel with the same specialisation loads it from there instead of compiling.
So at the first warmup step of a layout whose kernels compile, `WarmStart` starts
``install.py prepare --shape SPEC`` with ComfyUI's own Python (`sys.executable`) and environment
(hence the same caches), or hands the run shape to the owner's standby child: one started as
``install.py prepare --shape -`` when the node patched the model for a CUDA GPU (`standby_for`), whose
start-up (Python, torch, this pack: seconds) ran while ComfyUI loaded the model and encoded the prompt,
and which waits for the shape on its input (with no warmup step it takes the first sparse step's shape;
one no shape comes to is stopped there, ends when its input closes, or exits by itself after a while).
The child runs `backend.warmup.prepare_kernels` on the same layout, config, dtype and head size at one head
(`CHILD_HEADS`), which launches the kernels the sparse steps launch but for what depends on the head count; it
builds them side by side on a thread per core (`kernels/triton/build_ahead.py`: a dry run records them), which
this process cannot do safely. The first warmup step after the child ended prepares in this process at the
real head count: it loads the child's kernels from the cache and builds the rest. A sparse step that comes
before the child ended prepares in this process beside it, and the child keeps going until this process is
done: a kernel either of them built first loads from the cache in the other (on a cold cache the child's
builds soon overtake this process's; on a warm one, or with a new clip length's few kernels, this process is
done first, without waiting for the child's start-up). The preparation is shown and logged with its time. A
child that fails or runs past its budget is said once, and this process compiles the kernels itself, as it
does without the child. Once a child of one clip length has ended, a new length of the same kernels starts no
child: it prepares in this process at its first warmup step, where at most its new row-bucket kernels build
(`kernels/triton/radix_select.row_split`), in less time than a child's start-up. Nor does a run shape whose
every Triton kernel this process holds already (another model patched with the same kernels, e.g. after a
widget change): the first warmup step first tries a preparation that stops at the first kernel not in memory
(`backend.warmup.prepare_from_memory`); where it runs through, the standby child is stopped unused.

One child per run shape (`job_key`) per owner (a node's patched model and its clones), at most
MAX_JOBS at once; children are always reaped, and killed when their owner goes or the process exits.
The child holds a CUDA context (about half a GiB of GPU memory) and a one-head call's buffers while it runs;
a standby child holds neither until its shape comes (it has imported torch, not initialised CUDA).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

import torch

from ..backend.config import SparseConfig
from ..backend.layout import SequenceLayout
from ..backend.warmup import holds_kernels, kernel_fields, preparation_key, prepare_kernels, prepared, to_prepare
from ..notices import Notices, logger

log = logger()
PACK_DIR = Path(__file__).resolve().parent.parent
CHILD_BUDGET_S = 600.0  # a child still running after this is stopped (a cold compile takes seconds to a minute;
# the child also exits by itself then: bench.prepare.SHAPE_BUDGET_S)
MAX_JOBS = 4  # children (running or finished) an owner keeps; a model sees a handful of shapes
CHILD_HEADS = 1  # the child prepares one head: it shares the GPU with the model's own steps, and a call's memory
# grows with its heads; what only the real head count launches (the reblock split's wide-level chunk) is built by
# this process's preparation at a warmup step after the child ended
UP_LINE = "prepare --shape: compiling the kernels"  # the child's first line on its run shape, its imports done
STANDBY_SPEC = "-"  # the spec a standby child starts with: it imports, then reads its run shape from its input
STANDBY_LINE = "prepare --shape: waiting for the run shape"  # a standby child's first line, its imports done
STANDBY_KEY = ("standby",)  # where an owner keeps its standby child until a run shape comes


def job_key(layout: SequenceLayout, config: SparseConfig, dtype: torch.dtype, device: torch.device,
            head_dim: int, heads: int) -> tuple:
    """The run shape one child prepares: what `prepare_kernels` keys a layout's preparation by (the
    kernel-deciding config fields, dtype, device, head size and count), and the layout. Per layout, not per
    class: a clip length whose row-width buckets (radix-select rows, reblock levels) are new compiles
    those kernels (BENCHMARKS.md has the time), at a warmup step once a child of another length ended
    (`WarmStart.ended_beside`)."""
    return (*preparation_key(config, dtype, device, head_dim, heads), layout.signature())


def shape_spec(layout: SequenceLayout, config: SparseConfig, dtype: torch.dtype, device: torch.device,
               head_dim: int) -> str:
    """The JSON the child's ``prepare --shape`` reads (`bench.prepare.prepare_shape`), at `CHILD_HEADS` heads."""
    return json.dumps({"segments": [[s.start, s.stop, s.kind, s.grid] for s in layout.segments],
                       "config": dict(kernel_fields(config)), "dtype": str(dtype).removeprefix("torch."),
                       "head_dim": head_dim, "heads": CHILD_HEADS, "device": str(device)})


def prepare_command(spec: str) -> list[str]:
    """The child's command line: this pack's ``install.py prepare --shape SPEC`` with this Python."""
    return [sys.executable, str(PACK_DIR / "install.py"), "prepare", "--shape", spec]


@dataclass
class Job:
    """One child process and the file its output goes to (a named file: this process reads it through
    its own handle, whose offset is not the child's)."""

    process: subprocess.Popen
    output: IO[str]
    started: float
    budget_s: float
    problem: str | None = None  # why it failed, once it has
    reported: bool = False  # its outcome was said (once)
    stopped: bool = False  # a sparse step came first and stopped it
    ended: float | None = None

    def poll(self) -> int | None:
        """The child's exit code (reaping it), or None while it runs; past its budget it is stopped."""
        code = self.process.poll()
        if code is None and time.perf_counter() - self.started > self.budget_s:
            self.stop()
            self.problem = f"still running after {self.budget_s:.0f} s, stopped"
            code = self.process.returncode
        if code is not None and self.ended is None:
            self.ended = time.perf_counter()
            if code != 0 and self.problem is None:
                self.problem = f"exit code {code}: {self.last_line() or 'no message'}"
        return code

    def text(self) -> str:
        """What the child wrote so far (its progress, or its error), read through a handle of its own:
        seeking the child's (shared offset) would make a running child write over its start."""
        try:
            with open(self.output.name, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def last_line(self) -> str:
        """The last non-empty line the child wrote."""
        return next((line.strip() for line in reversed(self.text().splitlines()) if line.strip()), "")

    def up(self) -> bool:
        """Whether the child's start-up is over: it wrote `UP_LINE` and is compiling (or done)."""
        return UP_LINE in self.text()

    def stop(self) -> None:
        """Kill the child if it runs, and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def close(self) -> None:
        """Close and remove the output file (the child ended)."""
        self.output.close()
        Path(self.output.name).unlink(missing_ok=True)


def stop_all(jobs: dict[tuple, Job]) -> None:
    """Kill and reap every child in `jobs`, closing their output files (the owner's finaliser)."""
    for job in jobs.values():
        job.stop()
        job.close()
    jobs.clear()


@dataclass
class WarmStart:
    """The children compiling kernels for one owner (a node's patched model, shared by its clones).

    Args:
        command: the child's command line for a spec (`prepare_command`; tests give a stand-in).
        budget_s: seconds after which a child is stopped.
        limit: children kept at once.
    """

    command: Callable[[str], list[str]] = prepare_command
    budget_s: float = CHILD_BUDGET_S
    limit: int = MAX_JOBS
    jobs: dict[tuple, Job] = field(default_factory=dict)
    notices: Notices = field(default_factory=lambda: Notices(limit=4 * MAX_JOBS))

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.finalizer = weakref.finalize(self, stop_all, self.jobs)  # also at interpreter exit

    def start(self, key: tuple, spec: str) -> bool:
        """Start the child preparing run shape `key` (`spec` for its command), unless one was started.

        Returns:
            Whether a child for `key` is still running, so the caller leaves the preparation to it for
            now. False once it ended (the caller then prepares: loading what the child compiled from the
            cache, or compiling itself after a failure, which is said once), when the owner holds `limit`
            running children or when the child could not start (said once).
        """
        with self.lock:
            job = self.jobs.get(key)
            if job is not None:
                if job.poll() is None:
                    return True
                self.report(job)
                return False
            for old in [k for k, job in self.jobs.items() if job.poll() is not None]:
                if len(self.jobs) < self.limit:
                    break
                self.jobs.pop(old).close()
            if len(self.jobs) >= self.limit:
                return False
            job = self.assign_spare(spec) or self.spawn(spec)
            if job is None:
                return False
            self.jobs[key] = job
            log.info("adaptive sparse attention: compiling the sparse-attention kernels in a child process (pid %d) "
                     "while the dense warmup steps run", job.process.pid)
            return True

    def spawn(self, spec: str) -> Job | None:
        """A new child for `spec` (`STANDBY_SPEC`: a standby child, its input a pipe), or None when it could
        not start (said once)."""
        output = tempfile.NamedTemporaryFile(mode="w+", encoding="utf-8", errors="replace", prefix="asa_child_",
                                             suffix=".log", delete=False)
        standby = spec == STANDBY_SPEC
        try:
            process = subprocess.Popen(self.command(spec), stdout=output, stderr=subprocess.STDOUT,
                                       stdin=subprocess.PIPE if standby else subprocess.DEVNULL, text=True,
                                       encoding="utf-8", cwd=str(PACK_DIR), env=dict(os.environ, PYTHONUNBUFFERED="1"))
        except OSError as err:
            output.close()
            Path(output.name).unlink(missing_ok=True)
            self.notices.say(f"adaptive sparse attention: the child process that would compile the kernels "
                             f"during the dense steps did not start ({err}); they compile in this process")
            return None
        return Job(process, output, time.perf_counter(), math.inf if standby else self.budget_s)

    def standby(self) -> bool:
        """Start a standby child now (when the node patches a model for a CUDA GPU): its start-up (Python,
        torch, this pack: seconds, BENCHMARKS.md) then runs while ComfyUI loads the model and encodes the
        prompt, and the first warmup step hands it the run shape (`start`) instead of starting a child.
        Without warmup steps the first sparse step hands it the shape instead. If no shape comes it is stopped
        at the first sparse step or when its owner goes, and exits by itself after `bench.prepare.STANDBY_WAIT_S`.

        Returns:
            Whether a standby child was started (not when one exists, a child ran already or it failed).
        """
        with self.lock:
            if self.jobs:
                return False
            job = self.spawn(STANDBY_SPEC)
            if job is None:
                return False
            self.jobs[STANDBY_KEY] = job
            log.info("adaptive sparse attention: a standby child process (pid %d) starts up now to compile the "
                     "sparse-attention kernels once the run's shape is known", job.process.pid)
            return True

    def assign_spare(self, spec: str) -> Job | None:
        """The standby child with `spec` written to it, its budget running from now; None without one (a
        standby child that ended meanwhile is reaped and said)."""
        job = self.jobs.pop(STANDBY_KEY, None)
        if job is None:
            return None
        if job.poll() is None:
            try:
                job.process.stdin.write(spec + "\n")
                job.process.stdin.close()
            except OSError:
                job.stop()
            else:
                job.started, job.budget_s = time.perf_counter(), self.budget_s
                return job
        job.poll()
        log.info("adaptive sparse attention: the standby child process ended before the run shape came (%s)",
                 job.problem or job.last_line() or "no message")
        job.close()
        return None

    def drop_spare(self) -> None:
        """Stop a standby child that no run shape came to (the first sparse step: nothing is compiled ahead)."""
        if STANDBY_KEY not in self.jobs:  # the usual case, at every sparse block call: no lock taken
            return
        with self.lock:
            job = self.jobs.pop(STANDBY_KEY, None)
            if job is not None:
                job.stop()
                job.close()

    def ended_beside(self, key: tuple) -> bool:
        """Whether the child of another layout of `key`'s kernels (`job_key` but for the layout) has ended.
        This process has then prepared that layout, or can load it from the cache, and a new clip length
        builds at most its few row-bucket kernels, here at a warmup step, in less time than a child's start-up."""
        with self.lock:
            return any(k not in (key, STANDBY_KEY) and k[:-1] == key[:-1] and job.poll() is not None
                       for k, job in self.jobs.items())

    def take_over(self, key: tuple, prepare: Callable[[], object] | None = None) -> bool | None:
        """Before the first sparse step of `key`: end its child. A child still running keeps going while this
        process runs `prepare`, then is stopped: whichever process builds a kernel first, the other loads it
        from Triton's cache (the child builds side by side, this process one after the other; on a warm
        cache, or with only a new clip length's few kernels to build, this process is done first).

        Args:
            key: the run shape (`job_key`).
            prepare: this process's preparation (`backend.warmup.prepare_kernels`), run beside a child still
                running; None: none runs here.
        Returns:
            True when the child had compiled the kernels, False when it was stopped or failed (said once),
            None when there is no child for `key`.
        """
        with self.lock:
            job = self.jobs.get(key)
            if job is None:
                return None
            if job.poll() is None:
                came = time.perf_counter() - job.started
                phase = "compiling" if job.up() else "still starting up"
                if prepare is not None:
                    prepare()
                if job.poll() is None:
                    job.stopped = True
                    job.problem = (f"a sparse step came {came:.1f} s after it started, {phase}; this process "
                                   f"prepared beside it in {time.perf_counter() - job.started - came:.1f} s, loading "
                                   "what the child had built")
                    job.stop()
                    job.poll()
            self.report(job)
            return job.problem is None

    @staticmethod
    def report(job: Job) -> None:
        """Say once how an ended child went: its time, or why it was stopped or failed."""
        if job.reported:
            return
        job.reported = True
        if job.problem is None:
            log.info("adaptive sparse attention: the child process compiled the kernels in %.1f s",
                     job.ended - job.started)
        elif job.stopped:
            log.info("adaptive sparse attention: the child process compiling the kernels was stopped (%s)",
                     job.problem)
        else:
            log.warning("adaptive sparse attention: the child process compiling the kernels failed (%s); they "
                        "compile in this process instead", job.problem)

    def close(self) -> None:
        """Kill and reap every child (the owner's finaliser does this when the owner goes)."""
        with self.lock:
            stop_all(self.jobs)


def start_during_warmup(warm: WarmStart, layout: SequenceLayout, config: SparseConfig, dtype: torch.dtype,
                        device: torch.device, head_dim: int, heads: int,
                        from_memory: Callable[[], float | None] | None = None) -> bool:
    """At a warmup step (or at the first sparse step, for a standby child no warmup step came to): start the
    child for this run shape when its kernels compile on this GPU and this layout is not prepared yet, unless
    `from_memory` prepared it from the kernels this process holds (`backend.warmup.prepare_from_memory`: the
    standby child is then stopped before it touches the GPU) or a child of another clip length of its kernels
    has ended (`WarmStart.ended_beside`). Returns whether the child is still running (the warmup step then
    leaves the preparation to it); once it ended, a warmup step prepares in this process, which loads what the
    child compiled from Triton's cache and compiles what only a process's memory keeps (cuDNN-frontend's
    kernels), while the steps are still dense."""
    if device.type != "cuda" or to_prepare(layout, config, dtype, device, head_dim, heads) is None:
        return False
    key = job_key(layout, config, dtype, device, head_dim, heads)
    if key not in warm.jobs:
        if from_memory is not None and from_memory() is not None:  # every kernel in memory: prepared, no child
            warm.drop_spare()
            return False
        if warm.ended_beside(key):  # a new clip length of kernels this process has
            return False
    return warm.start(key, shape_spec(layout, config, dtype, device, head_dim))


def take_over_before_sparse(warm: WarmStart, layout: SequenceLayout, config: SparseConfig, dtype: torch.dtype,
                            device: torch.device, head_dim: int, heads: int,
                            announce: Callable[[str], None] | None = None,
                            from_memory: Callable[[], float | None] | None = None) -> bool | None:
    """Before a sparse step of a layout not prepared yet: end its child, if any (`WarmStart.take_over`, which
    prepares here beside a child still running; `announce` shows that preparation's message). A standby child
    no warmup step handed a run shape to (``warmup_mode`` speed: the first step is sparse) takes this one and
    builds beside this process, unless `from_memory` prepares it here (`start_during_warmup`); one whose shape
    compiles nothing here is stopped."""
    if STANDBY_KEY in warm.jobs:
        start_during_warmup(warm, layout, config, dtype, device, head_dim, heads, from_memory)
    warm.drop_spare()
    if not warm.jobs or prepared(layout, config, dtype, device, head_dim, heads):
        return None
    return warm.take_over(job_key(layout, config, dtype, device, head_dim, heads),
                          lambda: prepare_kernels(layout, config, dtype, device, head_dim, heads, announce=announce))


def standby_for(warm: WarmStart, device: torch.device, config: SparseConfig) -> bool:
    """When a node patches a model: start `warm`'s standby child where a run's kernels will compile (a CUDA
    device, Triton importable, a kernel setting other than the torch reference), unless this process ran
    sparse steps on that device already (`backend.warmup.holds_kernels`): a model patched again with other
    widgets then prepares from memory, and a child starting up beside that preparation only slows it
    (BENCHMARKS.md, the template presets on the H200). Returns whether it started."""
    if device.type != "cuda" or config.kernel == "torch" or importlib.util.find_spec("triton") is None:
        return False
    if holds_kernels(device):
        log.info("adaptive sparse attention: no standby child: this process holds the sparse-attention kernels "
                 "for %s already", device)
        return False
    return warm.standby()
