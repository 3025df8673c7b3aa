"""Block-sparse attention under ``auto`` on the fastest kernel here that meets the run's error bound.

The candidates are the rows of `registry.SPARSE_KERNELS` that run for the call (today cuDNN-frontend
and Triton in bf16, Triton's 8-bit loop). Per GPU, shape class and precision bound, each is run once
on the call's real plan, checked on sampled rows against the float32 reference (`sample.Sample`),
within `dense.choice.tolerance` of the bound ("bf16": 3 units of an exact kernel's rounding error;
"8-bit": 10 units, so a bf16 kernel meets an 8-bit bound too: the setting bounds the error, it does
not name a kernel), and timed; a candidate that raises or misses the bound is said and skipped. The
ones that met it, fastest first, are the choice: kept in memory (bounded), saved in a small JSON
file (`dense/store.ChoiceFile`) so later processes take the same kernel after one check on their
first call, and named once in the console. Afterwards a call is a dictionary lookup on metadata:
no host synchronisation.

At call time a chosen kernel that raises (cuDNN-frontend's op was seen to raise UnicodeDecodeError in
a process where other CuTe DSL / 8-bit kernels had run: BENCHMARKS.md) is said once per owner, dropped
for this process, and the call runs on the next kernel of the choice (same plan, same outputs), in the end on
the registry's family; strict mode raises instead. A sticky CUDA error (`cuda_errors.poisons_context`: the
context is lost, every later kernel would fail too) is never skipped: the call stops with it. Fewer than two
candidates: nothing to choose, the registry's family runs.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ...notices import Notices, logger
from ...timer import median_ms
from ...version import __version__
from ..cuda_errors import poisons_context
from ..dense.choice import describe, device_key, tolerance
from ..dense.store import MAX_CHOICES, ChoiceFile, Remembered, choice_path
from ..plan import BlockSparsePlan, QuerySummaries
from ..registry import SPARSE_KERNELS, current_host, load
from ..vocabulary import SparseKernel, Target
from .sample import Sample

log = logger()

CACHE_ENV = "ADAPTIVE_SPARSE_SPARSE_CACHE"
REPS = 3  # timed calls per candidate, after one untimed
# the ratio classes: 0.0125 to 0.8, a factor of 2 apart, so every topk_ratio the node runs (0.01 to 1: the widget's
# range, an error target's floor to cap, a ramp's densities) is within a factor of sqrt(2) of one
RATIO_CLASSES = tuple(0.2 * 2.0 ** k for k in range(-4, 3))
# the largest row bucket: longer calls share it (their 1,024 or more query blocks a head fill the GPU many times
# over), so `prepare` measures each class there once, at its first shape past 32,768 rows, not up to 60 s
ROWS_CAP = 1 << 16


@dataclass(frozen=True)
class Choice:
    """The choice of one shape class: the candidates that met the bound, fastest first (empty: the
    registry's family runs), and the line the console and the report show."""

    ranking: tuple[str, ...]
    summary: str


def default_cache_path(user_dir: str | os.PathLike | None = None) -> Path:
    """Where the measured sparse choices are saved: ``ADAPTIVE_SPARSE_SPARSE_CACHE`` if set, else
    ``<user_dir>/adaptive_sparse_attention/sparse_choices.json`` (ComfyUI's user directory), else
    ``adaptive_sparse_attention/sparse_kernels.json`` in the user's cache folder."""
    return choice_path(CACHE_ENV, user_dir, "sparse_choices.json", "sparse_kernels.json")


def ratio_class(ratio: float) -> float:
    """The class of a routing ratio (``topk_ratio``) the choice is keyed by: the nearest of RATIO_CLASSES on a
    log scale (the lower one at a tie). Every ratio maps to one, so a run whose ratio moves (an error target, a
    ramped warmup) meets only the classes `prepare` measured.

    Args:
        ratio: the call's ``topk_ratio`` (above 0).
    Returns:
        One of RATIO_CLASSES.
    """
    return min(RATIO_CLASSES, key=lambda c: (abs(math.log(ratio / c)), c))


def rows_bucket(rows: int) -> int:
    """The row bucket the choice is keyed by: the power of two at or above `rows`, at most ROWS_CAP."""
    return min(ROWS_CAP, 1 << max(0, math.ceil(math.log2(max(1, rows)))))


def shape_class(q: torch.Tensor, plan: BlockSparsePlan, precision: str, ratio: float) -> str:
    """What the ranking depends on besides the GPU, from metadata only: dtype, batch, heads, head size, row
    bucket (`rows_bucket`), block size, the class of the routing ratio (`ratio_class`), the tail, the bound."""
    B, H, S, D = q.shape
    tail = "none" if plan.tail is None else "query" if isinstance(plan.tail, QuerySummaries) else "block"
    return (f"{str(q.dtype).removeprefix('torch.')} B{B} H{H} D{D} rows<={rows_bucket(S)} block {plan.block_size} "
            f"ratio class {ratio_class(ratio):g} tail {tail} bound {precision}")


class SparseChoices(Remembered):
    """The sparse kernel of each shape class: measured, or saved by an earlier process and checked.

    One object per owner (a node's patched model, shared by its clones: the choices are facts of the
    machine; or a layout, for calls of the engine API); its memory holds at most MAX_CHOICES classes.

    Args:
        path: the JSON file of saved choices; None: `default_cache_path()`.
        timer: milliseconds of one call of a thunk; None: CUDA events on a GPU, the wall clock on the CPU.
        persist: whether the file is read and written; None: on CUDA only (CPU timings vary run to run).
    """

    def __init__(self, path: Path | None = None, timer: Callable[[Callable[[], object]], float] | None = None,
                 persist: bool | None = None):
        self.file = ChoiceFile(default_cache_path() if path is None else path)
        self.timer = timer
        self.persist = persist
        self.lock = threading.Lock()
        self.choices: dict[str, Choice] = {}
        self.devices: dict[tuple[str, int | None], str] = {}
        self.notices = Notices(limit=MAX_CHOICES)

    @property
    def path(self) -> Path:
        """The JSON file of saved choices."""
        return self.file.path

    def key(self, q: torch.Tensor, plan: BlockSparsePlan, precision: str, ratio: float) -> str:
        """The stored key of a call: the GPU and build (`dense.choice.device_key`), then `shape_class`."""
        device = self.devices.get((q.device.type, q.device.index))
        if device is None:
            device = self.describe_device(q.device)
        return f"{device}|{shape_class(q, plan, precision, ratio)}"

    @torch.compiler.disable
    def describe_device(self, device: torch.device) -> str:
        """The key prefix of `device`, computed once per device (outside torch.compile)."""
        text = device_key(device) if device.type == "cuda" else f"pack {__version__}|{device.type}|torch {torch.__version__}"
        self.devices[(device.type, device.index)] = text
        return text

    @staticmethod
    def candidates(q: torch.Tensor, plan: BlockSparsePlan, precision: str) -> tuple[SparseKernel, ...]:
        """The `SPARSE_KERNELS` rows that run this call and may meet `precision`'s bound (an 8-bit kernel
        only under an 8-bit bound), in the table's order."""
        target = Target.of(q.device, q.dtype, q.shape[-1], plan.block_size)
        host = current_host()
        return tuple(k for k in SPARSE_KERNELS if (k.precision == "bf16" or precision == "8-bit")
                     and k.unavailable(target, host) is None)

    def choice(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
               precision: str, ratio: float) -> tuple[str, Choice]:
        """(key, choice) of this call at routing ratio `ratio`: a lookup, or on a class's first use the
        measurement (`first_use`)."""
        key = self.key(q, plan, precision, ratio)
        found = self.choices.get(key)
        return key, found if found is not None else self.first_use(key, q, k, v, plan, precision, ratio)

    @torch.compiler.disable
    def first_use(self, key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                  precision: str, ratio: float) -> Choice:
        """The saved choice of `key` if it still runs and meets the bound here, else a measurement; said
        once, kept in memory, saved when measured (where `persist`)."""
        with self.lock:
            found = self.choices.get(key)
            if found is not None:
                return found
            kernels = self.candidates(q, plan, precision)
            if len(kernels) < 2:
                return self.remember(key, Choice((), ""))
            persist = q.is_cuda if self.persist is None else self.persist
            device = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
            with device, torch.no_grad():
                sample = Sample.of(q, k, v, plan)
                bound = tolerance(q.dtype, precision)
                shape = shape_class(q, plan, precision, ratio)
                found = self.saved(key, shape, kernels, q, k, v, plan, sample, bound) if persist else None
                if found is None:
                    found = self.measure(shape, kernels, q, k, v, plan, sample, bound)
                    if persist and found.ranking:
                        self.file.save(key, ",".join(found.ranking))
            log.info("%s", found.summary)
            return self.remember(key, found)

    def saved(self, key: str, shape: str, kernels: tuple[SparseKernel, ...], q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, plan: BlockSparsePlan, sample: Sample, bound: float) -> Choice | None:
        """The choice an earlier process saved for `key`, when its first kernel still runs and meets the bound."""
        text = self.file.read().get(key)
        if text is None:
            return None
        names = {kernel.name: kernel for kernel in kernels}
        ranking = tuple(n for n in text.split(",") if n in names)
        first = names.get(ranking[0]) if ranking else None
        try:
            ok = first is not None and sample.error(run(first, q, k, v, plan)[0]) <= bound
        except Exception as exc:  # checked below: measured again
            if poisons_context(exc):
                raise
            ok = False
        if not ok:
            self.notices.say(f"the saved sparse kernel {text!r} for {shape} does not run or meet the bound here: "
                             "measuring again", logging.INFO)
            return None
        return Choice(ranking, f"sparse attention for {shape} runs on {first.label} (saved in {self.path}, checked)")

    def measure(self, shape: str, kernels: tuple[SparseKernel, ...], q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, plan: BlockSparsePlan, sample: Sample, bound: float) -> Choice:
        """Every candidate run on the plan, checked on the sample and timed; the ones within `bound`, fastest first."""
        timer = self.timer or (lambda fn: median_ms(fn, q.device, reps=REPS))
        times: dict[str, float] = {}
        said: list[str] = []
        for kernel in kernels:
            try:
                error = sample.error(run(kernel, q, k, v, plan)[0])
                if not error <= bound:
                    self.skip(said, f"sparse kernel {kernel.label} differs from the float32 reference on the sampled "
                                    f"rows of {shape} (relative L2 {error:.2e}, more than the {bound:.1e} allowed)")
                    continue
                times[kernel.name] = timer(lambda: run(kernel, q, k, v, plan))
                said.append(f"{kernel.label} {times[kernel.name]:.3g} ms (error {error:.1e})")
            except Exception as exc:  # a kernel that cannot run here, or fails on this process's state
                if poisons_context(exc):
                    raise
                self.skip(said, f"sparse kernel {kernel.label} failed on {shape} ({describe(exc)}, {origin(exc)})")
        order = [kernel.name for kernel in kernels]
        ranking = tuple(sorted(times, key=lambda n: (times[n], order.index(n))))
        labels = {kernel.name: kernel.label for kernel in kernels}
        outcome = (f"runs on {labels[ranking[0]]}" if ranking else
                   "runs on the registry's kernel: no candidate met the bound")
        return Choice(ranking, f"sparse attention for {shape} {outcome} (measured, bound {bound:.1e} relative L2: "
                               + "; ".join(said) + ")")

    def skip(self, said: list[str], message: str) -> None:
        """Say once that a candidate is skipped, and keep the reason for the choice's summary."""
        self.notices.say(f"{message}: skipped", logging.WARNING)
        said.append(message.removeprefix("sparse kernel "))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan, precision: str,
               fallback: tuple[str, Any], strict: bool, notices: Notices, *, ratio: float
               ) -> tuple[torch.Tensor, torch.Tensor, str, str]:
        """(out, lse) of q, k, v under `plan` on the chosen kernel, with its name and the choice's summary.

        Args:
            q, k, v: [B, H, S, D], model order.
            plan: the call's plan.
            precision: the run's bound, "bf16" or "8-bit" (`SparseConfig.exact_precision`).
            fallback: (name, attention) of the registry's family, run at `precision` where nothing is chosen.
            strict: a chosen kernel that raises raises (else: said once into `notices`, the next one runs).
            notices: the owner's once-only record.
            ratio: the call's routing ratio (``topk_ratio``: its class keys the choice).
        Returns:
            (out [B, H, S, D] in q's dtype, lse [B, H, S] fp32, the kernel that ran, the choice's summary).
        """
        key, choice = self.choice(q, k, v, plan, precision, ratio)
        for name in choice.ranking:
            kernel = named(name)
            try:
                out, lse = run(kernel, q, k, v, plan)
                return out, lse, name, choice.summary
            except Exception as exc:
                if poisons_context(exc):
                    raise
                rest = tuple(n for n in self.choices.get(key, choice).ranking if n != name)
                self.remember(key, replace(choice, ranking=rest))
                message = f"sparse kernel {kernel.label} raised {describe(exc)} ({origin(exc)})"
                if strict:
                    raise RuntimeError(f"{message} (strict mode)") from exc
                notices.say(f"{message}; it is skipped for this shape in this process and the call runs on "
                            f"{named(rest[0]).label if rest else fallback[0]}")
        name, attention = fallback
        out, lse = attention.attend_blocks(q, k, v, plan, precision=precision)
        return out, lse, name, choice.summary


def origin(exc: BaseException) -> str:
    """Where `exc` was raised: the innermost frame's file, line and function (what a report of a failure
    inside another package needs first); for a text that would not decode, the bytes around the bad one
    (they say which text it was: a compiler log, a file, an error message)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"raised at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "no traceback"
    if isinstance(exc, UnicodeDecodeError) and isinstance(exc.object, (bytes, bytearray)):
        start, end = max(0, exc.start - 60), exc.start + 20
        where += f"; bytes {start}-{end} of the {len(exc.object)}: {bytes(exc.object[start:end])!r}"
    return where


def label(name: str, precision: str = "bf16") -> str:
    """How reports name the attention kernel `name` (a `SPARSE_KERNELS` row, or a family run at `precision`)."""
    row = next((r for r in SPARSE_KERNELS if r.name == name), None) or next(
        (r for r in SPARSE_KERNELS if r.attention.family == name and r.precision == precision), None)
    if row is not None:
        return row.label
    return "the torch reference" if name == "torch" else f"kernel={name!r} ({precision})"


def named(name: str) -> SparseKernel:
    """The `SPARSE_KERNELS` row called `name`."""
    return next(row for row in SPARSE_KERNELS if row.name == name)


def run(kernel: SparseKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        plan: BlockSparsePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `kernel` on q, k, v under `plan`, at its own precision."""
    return load(kernel.attention).attend_blocks(q, k, v, plan, precision=kernel.precision)
