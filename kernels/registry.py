"""The one table of operations x implementation families, and its resolution for a call.

Rows (`OPERATIONS`) are what a sparse call runs: the QKV producer's epilogue, the planner's stages and
the attention itself.
Each family (a package under kernels/: `reference`, `triton`, `cudnn`, `sm90`, `flash4`) declares its own
implementations in its `family.py`, with what each needs of the call (`Requirement`: device, dtype,
compute capability, head dim, block size, an optional package) and, where a kernel takes only some
inputs, what it needs of them (`accepts`, checked when it runs). Adding a family is one new package
and one entry in `FAMILIES` (a sparse attention and the planner's stages) or in `DENSE_KERNELS` (a
dense kernel the measured dense choice times against SDPA's and the host's); a sparse attention kernel
the measured sparse choice times under ``auto`` (`sparse_choice/`) is one row of `SPARSE_KERNELS`.

A family imports only the kernels root. An implementation that runs part of its work on another
family's kernels (the cuDNN attention packs Q/K/V and adds its tail with Triton's) declares them in
its row (`Implementation.borrows`), and `load` hands them in when it loads the row; a package above
the registry (the sparse choice checks on the torch oracle) asks for one by `helper`.

`FAMILIES` is the order ``auto`` prefers them in, and a named family's fallback runs the ones after
it. `resolve` turns (requested kernel, device, dtype, head dim, block size, capability) into one
`Kernels`: the family that runs the attention and every operation's implementation. Rules:
- ``auto`` takes the first family whose attention can run (CUDA only for the compiled ones):
  cuDNN where it runs and is installed, else Triton on a CUDA GPU, else the torch reference. Its
  attention is then the measured sparse choice among `SPARSE_KERNELS` where two or more run
  (`backend/attention.py`); this family's runs where fewer do, or none meets the bound.
- A family asked for by name that cannot run raises in strict mode, and otherwise runs the next
  one by that order (in the end the torch reference), saying so once per owner (still sparse).
- An operation runs the first family of the requested one and those after it that implements it.
- A stage whose kernel cannot take its inputs (`Stage`) raises in strict mode, and otherwise
  runs the torch reference, saying so once per owner.
`render` writes the table and ``auto``'s choice for a device (install.py prints it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import SparseAttentionError
from ..notices import Notices
from .cudnn.family import CUDNN, CUDNN_BF16
from .flash4.family import FLASH4
from .reference.family import TORCH
from .sm90.family import SM90, SM90_BF16
from .triton.family import TRITON, TRITON_8BIT, TRITON_BF16
from .vocabulary import DenseKernel, Family, Host, Implementation, Operation, SparseKernel, Target, names

FAMILIES: dict[str, Family] = {f.name: f for f in (CUDNN, SM90, TRITON, TORCH)}  # ``auto``'s order of preference
DENSE_KERNELS: tuple[DenseKernel, ...] = (FLASH4,)  # offered to the dense choice after SDPA's, in this order
# the measured sparse choice's candidates under ``auto``, in order of preference for equal times
SPARSE_KERNELS: tuple[SparseKernel, ...] = (CUDNN_BF16, SM90_BF16, TRITON_BF16, TRITON_8BIT)

ROWS = (  # (operation, what it does), in the order a call runs them
    ("norm_rope", "q/k RMSNorm and split-half RoPE of projected rows, q/k/v written head-major (the QKV producer)"),
    ("block_sums", "per-block sums of Q/K/V rows gathered by the tiling (pooling)"),
    ("block_summaries", "mean / reweighted tail summaries of every key block"),
    ("pooled_scores", "routing scores q_mean k_mean^T / sqrt(D), a window at a time"),
    ("quantised_scores", "8-bit routing scores of quantised block means"),
    ("select_blocks", "per-group TopK of the routing scores"),
    ("block_log_mass", "probe queries' log-mass per key block (head choice)"),
    ("top_share", "mass share in the heaviest blocks (head choice)"),
    ("metric_gram", "second moments of the reblock metric"),
    ("metric_project", "reblock tree features (projection on the metric basis)"),
    ("partition_level", "one level of the reblock tree split"),
    ("attention", "block-sparse attention under the plan"),
)
OPERATIONS: tuple[Operation, ...] = tuple(  # the torch reference first
    Operation(name, does, tuple(i for f in reversed(FAMILIES.values()) if (i := f.of(name)) is not None))
    for name, does in ROWS)
ATTENTION = OPERATIONS[-1]
PACKAGES = tuple(sorted({p for op in OPERATIONS for i in op.implementations for r in i.requires for p in r.packages}))


def current_host() -> Host:
    """This process's facts for every optional package a family asks about (read now, not cached)."""
    return Host.current(PACKAGES)


def choose_family(requested: str, target: Target, host: Host, strict: bool = False,
                  notices: Notices | None = None) -> str:
    """The name in `FAMILIES` that runs `target` when `requested` ("auto" or a name) is asked for.

    A named family that cannot run raises RuntimeError in strict mode; otherwise the next one by
    order runs, said once into `notices` (the caller's record; None: not said)."""
    if requested == "auto":
        return next(f.name for f in FAMILIES.values() if f.may_auto(target) and f.unavailable(target, host) is None)
    if requested not in FAMILIES:
        raise SparseAttentionError(f"kernel={requested!r} is not allowed: expected 'auto' or one of "
                         + ", ".join(repr(n) for n in FAMILIES))
    reason = FAMILIES[requested].unavailable(target, host)
    if reason is None:
        return requested
    message = f"kernel={requested!r} cannot run: {reason}"
    later = list(FAMILIES)[list(FAMILIES).index(requested) + 1:]
    instead = None if strict else next(
        n for n in later if FAMILIES[n].may_auto(target) and FAMILIES[n].unavailable(target, host) is None)
    what = "the torch reference kernels" if instead == "torch" else f"kernel={instead!r}"
    if strict or notices is not None:
        (Notices() if notices is None else notices).fallback(message, f"using {what} instead (still sparse)", strict)
    return instead


@dataclass(frozen=True)
class Stage:
    """One operation as resolved for a call: its implementation, and the torch reference it runs
    instead on inputs the implementation does not take (strict mode raises)."""

    operation: str
    family: str
    function: Callable
    reference: Callable
    accepts: Callable[..., str | None] | None
    strict: bool
    notices: Notices = field(compare=False, repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        reason = None if self.accepts is None else self.accepts(*args, **kwargs)
        if reason is None:
            return self.function(*args, **kwargs)
        self.notices.fallback(f"{self.operation}: the {self.family} kernel cannot take these inputs ({reason})",
                              "running the torch reference instead", self.strict)
        return self.reference(*args, **kwargs)


@dataclass(frozen=True)
class Kernels:
    """Every operation's implementation for one call (`resolve`): the producer's epilogue and the planner's
    stages as `Stage`s, and the attention, whose `attend_blocks(q, k, v, plan) -> (out, lse)` is defined in
    its kernel's file (`reference/reference.py`, `triton/op.py`, `cudnn/op.py`)."""

    family: str
    compiles: bool
    attention: Any
    norm_rope: Stage
    block_sums: Stage
    block_summaries: Stage
    pooled_scores: Stage
    quantised_scores: Stage
    select_blocks: Stage
    block_log_mass: Stage
    top_share: Stage
    metric_gram: Stage
    metric_project: Stage
    partition_level: Stage


def resolve(requested: str, device: torch.device, dtype: torch.dtype, *, strict: bool = False,
            head_dim: int | None = None, block_size: int | None = None, capability: tuple[int, int] | None = None,
            host: Host | None = None, notices: Notices | None = None, precision: str = "bf16") -> Kernels:
    """The `Kernels` of a call.

    Args:
        requested: "auto" or a name in `FAMILIES` (`SparseConfig.kernel`).
        device, dtype, head_dim, block_size: of the call's Q/K/V and plan (None: any value fits).
        strict: raise instead of falling back (named family, or a stage's inputs).
        capability: the CUDA compute capability (default: read from `device`).
        host: this process's packages (default: `current_host()`).
        notices: the owner's once-only record of what was said (default: a new one).
        precision: the exact loop's arithmetic, "bf16" or "8-bit" (`SparseConfig.exact_precision`).
    Returns:
        The resolution: `family` is the name that runs the attention.
    """
    target = Target.of(device, dtype, head_dim, block_size, capability, precision)
    host = current_host() if host is None else host
    notices = Notices() if notices is None else notices
    chosen = list(FAMILIES)[list(FAMILIES).index(choose_family(requested, target, host, strict, notices)):]
    stages: dict[str, Any] = {}
    for name, _ in ROWS:
        impl = next(i for i in (FAMILIES[f].of(name) for f in chosen)
                    if i is not None and i.unmet(target, host) is None)
        if name == "attention":
            stages[name] = load(impl)
            continue
        stages[name] = Stage(name, impl.family, load(impl), load(FAMILIES["torch"].of(name)), impl.accepts, strict,
                             notices)
    return Kernels(chosen[0], FAMILIES[chosen[0]].compiles, **stages)


def resolve_family(requested: str, device: torch.device, dtype: torch.dtype, strict: bool = False,
                   head_dim: int | None = None, block_size: int | None = None) -> str:
    """The name of the family `resolve` would run (nothing is said about a fallback)."""
    return choose_family(requested, Target.of(device, dtype, head_dim, block_size), current_host(), strict)


def helper(family: str, name: str) -> Callable:
    """`family`'s helper `name` (`Family.helpers`), loaded: what an implementation that borrows it is handed
    (`load`), or what a package above the registry runs of that family (the sparse choice's oracle)."""
    found = next((h for h in FAMILIES[family].helpers if h.operation == name), None)
    if found is None:
        raise LookupError(f"the {family!r} family lends no helper {name!r}")
    return load(found)


def load(impl: Implementation) -> Any:
    """`impl`'s function (or attention object), loaded with the helpers it borrows handed in by name
    (`Implementation.borrows`)."""
    return impl.load(**{name: helper(family, name) for family, name in impl.borrows})


def unavailable_reason(family: str, device: torch.device, dtype: torch.dtype | None = None,
                       head_dim: int | None = None, block_size: int | None = None) -> str | None:
    """Why `family` (a `FAMILIES` name) cannot run a call on `device` (None: it can)."""
    return FAMILIES[family].unavailable(Target.of(device, dtype, head_dim, block_size), current_host())


AUTO_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def auto_choices(target: Target, host: Host) -> dict[torch.dtype, str]:
    """``auto``'s family for every dtype a call may have, on `target` (its dtype is ignored)."""
    return {d: choose_family("auto", Target(target.device, target.capability, d, target.head_dim, target.block_size),
                             host) for d in AUTO_DTYPES}


def operation_lines() -> list[str]:
    """The table's rows as text: every operation with the families that implement it and what each needs."""
    lines = []
    for op in OPERATIONS:
        cells = []
        for impl in op.implementations:
            needs = [r.label for r in impl.requires] + ([f"inputs: {impl.accepts_label}"] if impl.accepts_label else [])
            cells.append(impl.family + (f" [{'; '.join(needs)}]" if needs else ""))
        lines.append(f"{op.name} ({op.does}): " + " | ".join(cells))
    offered = [f"{d.name} ({d.label})" + (f" [{d.needs}]" if d.needs else "") for d in DENSE_KERNELS]
    sparse = [f"{k.name} ({k.label}, {k.precision})" for k in SPARSE_KERNELS]
    return lines + ["dense attention (the dense steps' exact kernel, measured per shape): SDPA's kernels | "
                    "the host's own attention | " + " | ".join(offered),
                    "sparse attention under auto (measured per shape class and precision bound): " + " | ".join(sparse)]


def render(target: Target, host: Host) -> list[str]:
    """The table for `target` as text lines: ``auto``'s choice per dtype, whether each family
    runs there (and why not), then `operation_lines`."""
    auto = auto_choices(target, host)
    lines = ["auto: " + ", ".join(f"{names((d,))} -> {name}" for d, name in auto.items())]
    for name, family in FAMILIES.items():
        reason = family.unavailable(Target(target.device, target.capability), host)
        lines.append(f"kernel {name!r}: " + ("runs here" if reason is None else f"not here ({reason})"))
    return lines + operation_lines()


def reference_kernels() -> Kernels:
    """The torch reference of every operation (any device and dtype; never falls back)."""
    stages = {op.name: Stage(op.name, "torch", load(op.of("torch")), load(op.of("torch")), None, True, Notices())
              for op in OPERATIONS if op is not ATTENTION}
    return Kernels("torch", FAMILIES["torch"].compiles, load(ATTENTION.of("torch")), **stages)


def or_reference(kernels: Kernels | None) -> Kernels:
    """`kernels`, or the torch reference of every operation where none are given."""
    return reference_kernels() if kernels is None else kernels
