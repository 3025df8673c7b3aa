"""The one table of operations x backends, and its resolution for a call.

Rows (`OPERATIONS`) are what a sparse call runs: the planner's stages and the attention itself.
Each row has implementations: `torch` (the pure-torch reference, every row), `triton` (the
Triton kernels) and `cudnn` (the attention's exact keys on cuDNN-frontend's block-sparse kernel,
its tail on Triton). An implementation declares what it needs of the call (`Requirement`:
device, dtype, compute capability, head dim, block size, an optional package) and, where a
kernel takes only some inputs, what it needs of them (`accepts`, checked when it runs).

A backend (`BACKENDS`, in the order ``auto`` prefers them) names the implementations it runs,
in order of preference. `resolve` turns (requested backend, device, dtype, head dim, block size,
capability) into one `Kernels`: the backend that runs and every operation's implementation.
Rules:
- ``auto`` takes the first backend whose attention can run (CUDA only for the compiled ones):
  cuDNN where it runs and is installed, else Triton on a CUDA GPU, else the torch reference.
- A backend asked for by name that cannot run raises in strict mode, and otherwise runs the next
  one by that order (in the end the torch reference), saying so once per owner (still sparse).
- A stage whose kernel cannot take its inputs (`Stage`) raises in strict mode, and otherwise
  runs the torch reference, saying so once per owner.
`render` writes the table and ``auto``'s choice for a device (install.py prints it).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import planner_reference as ref
from . import reblock_reference as tree_ref
from .configs import CONFIGS, TRITON_DTYPES
from .cudnn_attention import BLOCK_SIZE as CUDNN_BLOCK_SIZE
from .cudnn_attention import DTYPES as CUDNN_DTYPES
from .cudnn_attention import FAMILIES as CUDNN_FAMILIES
from .cudnn_attention import HEAD_DIMS as CUDNN_HEAD_DIMS
from .custom_op import CudnnAttention, TritonAttention
from .reference import ReferenceAttention

log = logging.getLogger("adaptive_sparse_attention")
TRITON_MIN_CAPABILITY = (8, 0)  # the kernels' 16-bit tensor-core paths and shared-memory plans start at Ampere
CUDNN_PACKAGE = "nvidia-cudnn-frontend"
CUDNN_INSTALL = "pip install nvidia-cudnn-frontend"  # brings nvidia-cutlass-dsl, its kernel compiler


@dataclass(frozen=True)
class Host:
    """Facts of this process that availability depends on: which optional packages import, and
    whether Triton runs under its CPU interpreter (``TRITON_INTERPRET=1``)."""

    triton: bool
    cudnn: bool
    interpret: bool

    @classmethod
    def current(cls) -> "Host":
        """The facts of this process, read now (nothing is cached: the caller owns the result)."""
        triton = importlib.util.find_spec("triton") is not None
        cudnn = importlib.util.find_spec("cudnn") is not None and \
            importlib.util.find_spec("cudnn.block_sparse_attention") is not None
        return cls(triton, cudnn, os.environ.get("TRITON_INTERPRET") == "1")


@dataclass(frozen=True)
class Target:
    """What a call runs on: device type, CUDA compute capability (None off CUDA), dtype, head dim
    and block size (None: not known yet, any value is assumed to fit), and the exact loop's
    arithmetic ("bf16": the inputs' own; "8-bit")."""

    device: str
    capability: tuple[int, int] | None = None
    dtype: torch.dtype | None = None
    head_dim: int | None = None
    block_size: int | None = None
    precision: str = "bf16"

    @classmethod
    def of(cls, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None,
           block_size: int | None = None, capability: tuple[int, int] | None = None,
           precision: str = "bf16") -> "Target":
        """The target of tensors on `device`; the capability is read from the device unless given
        (None where no GPU is visible: any capability is assumed to fit)."""
        device = torch.device(device)
        if capability is None and device.type == "cuda" and torch.cuda.is_available():
            capability = tuple(torch.cuda.get_device_capability(device))
        return cls(device.type, capability, dtype, head_dim, block_size, precision)


@dataclass(frozen=True)
class Requirement:
    """One fact an implementation needs of its call: `label` for the table, `unmet(target, host)`
    says why it does not hold (None: it holds)."""

    label: str
    unmet: Callable[[Target, Host], str | None]


def _names(values: tuple) -> str:
    return ", ".join(str(v).removeprefix("torch.") for v in values)


def _triton_device(t: Target, host: Host) -> str | None:
    if not host.triton:
        return "Triton is not installed"
    if t.device != "cuda" and not host.interpret:
        return f"the tensors are on {t.device}, and Triton runs on CUDA (or on CPU with TRITON_INTERPRET=1)"
    if t.device == "cuda" and t.capability is not None and tuple(t.capability) < TRITON_MIN_CAPABILITY:
        return (f"sm{t.capability[0]}{t.capability[1]} is older than the Triton kernels' "
                f"sm{TRITON_MIN_CAPABILITY[0]}{TRITON_MIN_CAPABILITY[1]}")
    return None


def _dtype_in(dtypes: tuple[torch.dtype, ...]) -> Requirement:
    return Requirement(f"dtype in ({_names(dtypes)})", lambda t, h: None if t.dtype is None or t.dtype in dtypes else
                       f"dtype {t.dtype} is not supported (expected one of {_names(dtypes)})")


def _head_dim_in(dims: tuple[int, ...]) -> Requirement:
    return Requirement(f"head_dim in {dims}", lambda t, h: None if t.head_dim is None or t.head_dim in dims else
                       f"head_dim {t.head_dim} is not supported (expected one of {dims})")


def _cudnn_device(t: Target, host: Host) -> str | None:
    if t.device != "cuda":
        return f"the tensors are on {t.device}, and cuDNN runs on CUDA"
    if not host.cudnn:
        return f"{CUDNN_PACKAGE} (with its block-sparse attention) is not installed"
    if not host.triton:
        return "Triton is not installed (it adds the tail)"
    if t.capability is not None and t.capability[0] not in CUDNN_FAMILIES:
        return (f"sm{t.capability[0]}{t.capability[1]} is not enabled for it (enabled: "
                + ", ".join(f"sm{f}x" for f in CUDNN_FAMILIES) + ")")
    return None


TRITON = (Requirement(f"CUDA sm{TRITON_MIN_CAPABILITY[0]}{TRITON_MIN_CAPABILITY[1]}+ (or CPU under "
                      "TRITON_INTERPRET=1), Triton installed", _triton_device), _dtype_in(TRITON_DTYPES))
TRITON_ATTENTION = TRITON + (_head_dim_in(tuple(sorted({d for _, d, _ in CONFIGS}))),)
CUDNN_ATTENTION = (
    Requirement("CUDA " + ", ".join(f"sm{f}x" for f in CUDNN_FAMILIES) + f", {CUDNN_PACKAGE} and Triton installed",
                _cudnn_device),
    _dtype_in(CUDNN_DTYPES), _head_dim_in(CUDNN_HEAD_DIMS),
    Requirement(f"block_size {CUDNN_BLOCK_SIZE}", lambda t, h: None if t.block_size in (None, CUDNN_BLOCK_SIZE) else
                f"block_size {t.block_size} is not supported (expected {CUDNN_BLOCK_SIZE})"),
    Requirement("precision bf16", lambda t, h: None if t.precision == "bf16" else
                f"precision {t.precision!r} is not supported (its 8-bit path returns no log-sum-exp to merge the tail "
                "with; the Triton kernel has the 8-bit loop)"))


def _fp32(what: str) -> Callable[..., str | None]:
    def accepts(x: torch.Tensor, *_: Any, **__: Any) -> str | None:
        return None if x.dtype == torch.float32 else f"{what} are {x.dtype}, the kernel takes float32"
    return accepts


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _mass_inputs(probes: torch.Tensor, k: torch.Tensor, perm: torch.Tensor, block_size: int) -> str | None:
    if not (_pow2(probes.shape[1]) and _pow2(block_size)):
        return f"{probes.shape[1]} probes and block_size {block_size}: the kernel takes powers of two >= 16"
    return None


def _feature_rank(x: torch.Tensor, *_: Any) -> str | None:
    return None if x.shape[-1] >= 16 else f"head_dim {x.shape[-1]}: the kernel's feature rank needs at least 16"


def _projection_rank(x: torch.Tensor, factor: torch.Tensor, proj: torch.Tensor) -> str | None:
    r = proj.shape[-1]
    return None if _pow2(r) else f"feature rank {r}: the kernel takes a power of two >= 16"


@dataclass(frozen=True)
class Implementation:
    """One backend's implementation of an operation: the function (a "module:name" of this package
    for the Triton kernels, imported only when resolved; for the attention an object whose
    `attend_blocks(q, k, v, plan)` runs it), what it needs of the call, and what it needs of its inputs
    (`accepts(*args)` says why not, None when it takes them)."""

    backend: str
    function: Any
    requires: tuple[Requirement, ...] = ()
    accepts: Callable[..., str | None] | None = None
    accepts_label: str = ""

    def load(self) -> Callable:
        """The function itself."""
        if not isinstance(self.function, str):
            return self.function
        module, name = self.function.split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)


@dataclass(frozen=True)
class Operation:
    """One row: an operation and its implementations (the torch reference first)."""

    name: str
    does: str
    implementations: tuple[Implementation, ...]

    def of(self, backend: str) -> Implementation | None:
        """This row's implementation on `backend`, or None."""
        return next((i for i in self.implementations if i.backend == backend), None)


def _torch(fn: Callable) -> Implementation:
    return Implementation("torch", fn)


def _triton(fn: str, accepts: Callable[..., str | None] | None = None, label: str = "",
            requires: tuple[Requirement, ...] = TRITON) -> Implementation:
    return Implementation("triton", fn, requires, accepts, label)


OPERATIONS: tuple[Operation, ...] = (
    Operation("block_sums", "per-block sums of Q/K/V rows gathered by the tiling (pooling)", (
        _torch(ref.block_sums_torch), _triton("block_stats:block_sums_triton"))),
    Operation("block_summaries", "mean / reweighted tail summaries of every key block", (
        _torch(ref.block_summaries_torch), _triton("block_stats:block_summaries_triton"))),
    Operation("pooled_scores", "routing scores q_mean k_mean^T / sqrt(D), a window at a time", (
        _torch(ref.pooled_scores_torch),
        _triton("block_scores:pooled_scores_triton", _fp32("block means"), "float32 means"))),
    Operation("quantised_scores", "8-bit routing scores of quantised block means", (
        _torch(ref.quantised_scores_torch), _triton("block_scores:quantised_scores_triton"))),
    Operation("select_blocks", "per-group TopK of the routing scores", (
        _torch(ref.select_blocks_torch),
        _triton("block_select:select_blocks_triton", _fp32("routing scores"), "float32 scores"))),
    Operation("block_log_mass", "probe queries' log-mass per key block (head choice)", (
        _torch(ref.block_log_mass_torch),
        _triton("block_mass:block_log_mass_triton", _mass_inputs, "probes and block size powers of two >= 16"))),
    Operation("top_share", "mass share in the heaviest blocks (head choice)", (
        _torch(ref.top_share_torch), _triton("block_mass:top_share_triton", _fp32("log-masses"), "float32"))),
    Operation("metric_gram", "second moments of the reblock metric", (
        _torch(tree_ref.gram_torch), _triton("reblock_features:gram_triton", _feature_rank, "head_dim >= 16"))),
    Operation("metric_project", "reblock tree features (projection on the metric basis)", (
        _torch(tree_ref.metric_project_torch),
        _triton("reblock_features:metric_project_triton", _projection_rank, "rank a power of two >= 16"))),
    Operation("partition_level", "one level of the reblock tree split", (
        _torch(tree_ref.partition_level_torch), _triton("reblock_split:partition_level_triton"))),
    Operation("attention", "block-sparse attention under the plan", (
        _torch(ReferenceAttention()), Implementation("triton", TritonAttention(), TRITON_ATTENTION),
        Implementation("cudnn", CudnnAttention(), CUDNN_ATTENTION))),
)
ATTENTION = OPERATIONS[-1]


@dataclass(frozen=True)
class Backend:
    """A column choice: the implementations it runs in order of preference, where ``auto`` (or a
    named backend's fallback) may take it (on "cuda" only, or on "any" device), and whether its
    kernels are compiled on first use (then worth preparing ahead of the first sparse step)."""

    name: str
    uses: tuple[str, ...]
    auto: str
    compiles: bool

    def may_auto(self, target: Target) -> bool:
        """Whether ``auto`` may take this backend for `target`."""
        return self.auto == "any" or target.device == self.auto

    def unavailable(self, target: Target, host: Host) -> str | None:
        """Why its attention cannot run for `target` (None: it can)."""
        impl = ATTENTION.of(self.uses[0])
        return next((r for r in (req.unmet(target, host) for req in impl.requires) if r), None)


BACKENDS: dict[str, Backend] = {
    "cudnn": Backend("cudnn", ("cudnn", "triton", "torch"), auto="cuda", compiles=True),
    "triton": Backend("triton", ("triton", "torch"), auto="cuda", compiles=True),
    "torch": Backend("torch", ("torch",), auto="any", compiles=False),
}


def choose_backend(requested: str, target: Target, host: Host, strict: bool = False,
                   notes: set[str] | None = None) -> str:
    """The name in `BACKENDS` that runs `target` when `requested` ("auto" or a name) is asked for.

    A named backend that cannot run raises RuntimeError in strict mode; otherwise the next one by
    order runs, said once into `notes` (the caller's record; None: not said)."""
    if requested == "auto":
        return next(b.name for b in BACKENDS.values() if b.may_auto(target) and b.unavailable(target, host) is None)
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is not allowed: expected 'auto' or one of "
                         + ", ".join(repr(n) for n in BACKENDS))
    reason = BACKENDS[requested].unavailable(target, host)
    if reason is None:
        return requested
    message = f"backend={requested!r} cannot run: {reason}"
    if strict:
        raise RuntimeError(message + " (strict mode)")
    later = list(BACKENDS)[list(BACKENDS).index(requested) + 1:]
    instead = next(n for n in later if BACKENDS[n].may_auto(target) and BACKENDS[n].unavailable(target, host) is None)
    if notes is not None and message not in notes:
        notes.add(message)
        what = "the torch reference kernels" if instead == "torch" else f"backend={instead!r}"
        log.warning("%s; using %s instead (still sparse)", message, what)
    return instead


@dataclass(frozen=True)
class Stage:
    """One operation as resolved for a call: its implementation, and the torch reference it runs
    instead on inputs the implementation does not take (strict mode raises)."""

    operation: str
    backend: str
    function: Callable
    reference: Callable
    accepts: Callable[..., str | None] | None
    strict: bool
    notes: set[str] = field(compare=False, repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        reason = None if self.accepts is None else self.accepts(*args, **kwargs)
        if reason is None:
            return self.function(*args, **kwargs)
        message = f"{self.operation}: the {self.backend} kernel cannot take these inputs ({reason})"
        if self.strict:
            raise RuntimeError(message + " (strict mode)")
        if message not in self.notes:
            self.notes.add(message)
            log.warning("%s; running the torch reference instead", message)
        return self.reference(*args, **kwargs)


@dataclass(frozen=True)
class Kernels:
    """Every operation's implementation for one call (`resolve`): the planner's stages as `Stage`s
    and the attention, whose `attend_blocks(q, k, v, plan) -> (out, lse)` is defined in its kernel's file
    (`reference.py` or `custom_op.py`)."""

    backend: str
    compiles: bool
    attention: Any
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
            host: Host | None = None, notes: set[str] | None = None, precision: str = "bf16") -> Kernels:
    """The `Kernels` of a call.

    Args:
        requested: "auto" or a name in `BACKENDS` (`SparseConfig.backend`).
        device, dtype, head_dim, block_size: of the call's Q/K/V and plan (None: any value fits).
        strict: raise instead of falling back (named backend, or a stage's inputs).
        capability: the CUDA compute capability (default: read from `device`).
        host: this process's packages (default: `Host.current()`).
        notes: the owner's once-only record of what was said (default: a new one).
        precision: the exact loop's arithmetic, "bf16" or "8-bit" (`SparseConfig.exact_precision`).
    Returns:
        The resolution: `backend` is the name that runs the attention.
    """
    target = Target.of(device, dtype, head_dim, block_size, capability, precision)
    host = Host.current() if host is None else host
    notes = set() if notes is None else notes
    backend = BACKENDS[choose_backend(requested, target, host, strict, notes)]
    stages: dict[str, Any] = {}
    for op in OPERATIONS:
        impl = next(i for i in (op.of(b) for b in backend.uses)
                    if i is not None and all(r.unmet(target, host) is None for r in i.requires))
        if op is ATTENTION:
            stages[op.name] = impl.load()
            continue
        stages[op.name] = Stage(op.name, impl.backend, impl.load(), op.of("torch").function, impl.accepts, strict, notes)
    return Kernels(backend.name, backend.compiles, **stages)


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, strict: bool = False,
                    head_dim: int | None = None, block_size: int | None = None) -> str:
    """The name of the backend `resolve` would run (nothing is said about a fallback)."""
    return choose_backend(requested, Target.of(device, dtype, head_dim, block_size), Host.current(), strict)


def unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype | None = None,
                       head_dim: int | None = None, block_size: int | None = None) -> str | None:
    """Why `backend` (a `BACKENDS` name) cannot run a call on `device` (None: it can)."""
    return BACKENDS[backend].unavailable(Target.of(device, dtype, head_dim, block_size), Host.current())


AUTO_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def auto_choices(target: Target, host: Host) -> dict[torch.dtype, str]:
    """``auto``'s backend for every dtype a call may have, on `target` (its dtype is ignored)."""
    return {d: choose_backend("auto", Target(target.device, target.capability, d, target.head_dim, target.block_size),
                              host) for d in AUTO_DTYPES}


def operation_lines() -> list[str]:
    """The table's rows as text: every operation with the backends that implement it and what each needs."""
    lines = []
    for op in OPERATIONS:
        cells = []
        for impl in op.implementations:
            needs = [r.label for r in impl.requires] + ([f"inputs: {impl.accepts_label}"] if impl.accepts_label else [])
            cells.append(impl.backend + (f" [{'; '.join(needs)}]" if needs else ""))
        lines.append(f"{op.name} ({op.does}): " + " | ".join(cells))
    return lines


def render(target: Target, host: Host) -> list[str]:
    """The table for `target` as text lines: ``auto``'s choice per dtype, whether each backend
    runs there (and why not), then `operation_lines`."""
    auto = auto_choices(target, host)
    lines = ["auto: " + ", ".join(f"{_names((d,))} -> {name}" for d, name in auto.items())]
    for name, backend in BACKENDS.items():
        reason = backend.unavailable(Target(target.device, target.capability), host)
        lines.append(f"backend {name!r}: " + ("runs here" if reason is None else f"not here ({reason})"))
    return lines + operation_lines()


def reference_kernels() -> Kernels:
    """The torch reference of every operation (any device and dtype; never falls back)."""
    stages = {op.name: Stage(op.name, "torch", op.of("torch").function, op.of("torch").function, None, True, set())
              for op in OPERATIONS if op is not ATTENTION}
    return Kernels("torch", BACKENDS["torch"].compiles, ATTENTION.of("torch").function, **stages)
