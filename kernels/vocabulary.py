"""The words an implementation family declares itself in, and that the registry resolves.

- `Target`: what a call runs on (device, capability, dtype, head dim, block size).
- `Host`: facts of this process (which optional packages import, whether Triton is interpreted).
- `Requirement`: one fact an implementation needs of a target and host, with the reason when unmet.
- `Implementation`: one family's function for one operation, what it needs of the call and of its inputs.
- `Operation`: one row of the table, with every family's implementation of it.
- `Family`: an implementation family (a package under kernels/): its implementations, where ``auto``
  may take it, whether its kernels compile on first use, and the helpers it lends other families.
- `DenseKernel`: a dense attention kernel a family offers the measured dense choice (`dense/`).
- `SparseKernel`: a block-sparse attention kernel at one arithmetic, a candidate of the measured
  sparse choice (`sparse_choice/`).
"""
from __future__ import annotations

import importlib.util
import os
from importlib import metadata
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch


def names(values: tuple) -> str:
    """`values` as a comma-separated list, dtypes without their ``torch.`` prefix."""
    return ", ".join(str(v).removeprefix("torch.") for v in values)


@dataclass(frozen=True)
class Host:
    """Facts of this process that availability depends on: which optional packages import (by module
    name), the installed release of the top-level ones (major.minor, from their metadata: a kernel
    written against one release's API names the releases it runs on), and whether Triton runs under
    its CPU interpreter (``TRITON_INTERPRET=1``)."""

    packages: frozenset[str] = frozenset()
    interpret: bool = False
    releases: frozenset[tuple[str, str]] = frozenset()

    def has(self, module: str) -> bool:
        """Whether `module` imports here."""
        return module in self.packages

    def release(self, module: str) -> str | None:
        """The major.minor release of the installed top-level `module` (None: unknown or not installed)."""
        return next((r for m, r in self.releases if m == module), None)

    @classmethod
    def current(cls, modules: Iterable[str]) -> "Host":
        """The facts of this process, read now for `modules` (nothing is cached: the caller owns the result)."""
        present = frozenset(m for m in modules if _importable(m))
        return cls(present, os.environ.get("TRITON_INTERPRET") == "1",
                   frozenset((m, r) for m in present if "." not in m and (r := _release(m)) is not None))


def _release(module: str) -> str | None:
    """The major.minor version of the distribution named `module`, read from its metadata (None: none)."""
    try:
        return ".".join(metadata.version(module).split(".")[:2])
    except metadata.PackageNotFoundError:
        return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


@dataclass(frozen=True)
class Target:
    """What a call runs on: device type, CUDA compute capability (None off CUDA), dtype, head dim
    and block size (None: not known yet, any value is assumed to fit), and the exact loop's
    arithmetic ("bf16": the inputs' own; "8-bit", `eight_bit.py`)."""

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
    says why it does not hold (None: it holds); `packages` are the optional modules it asks the
    `Host` about."""

    label: str
    unmet: Callable[[Target, Host], str | None]
    packages: tuple[str, ...] = ()


def dtype_in(dtypes: tuple[torch.dtype, ...]) -> Requirement:
    """The call's dtype is one of `dtypes`."""
    return Requirement(f"dtype in ({names(dtypes)})", lambda t, h: None if t.dtype is None or t.dtype in dtypes else
                       f"dtype {t.dtype} is not supported (expected one of {names(dtypes)})")


def head_dim_in(dims: tuple[int, ...]) -> Requirement:
    """The call's head dim is one of `dims`."""
    return Requirement(f"head_dim in {dims}", lambda t, h: None if t.head_dim is None or t.head_dim in dims else
                       f"head_dim {t.head_dim} is not supported (expected one of {dims})")


def float32_inputs(what: str) -> Callable[..., str | None]:
    """An `accepts` for a kernel whose first input must be float32 (`what` names it)."""
    def accepts(x: torch.Tensor, *_: Any, **__: Any) -> str | None:
        return None if x.dtype == torch.float32 else f"{what} are {x.dtype}, the kernel takes float32"
    return accepts


@dataclass(frozen=True)
class Implementation:
    """One family's implementation of an operation.

    `load()` returns the function (for the attention an object whose `attend_blocks(q, k, v, plan)`
    runs it); a family whose modules must not be imported with the package (Triton decorates its
    kernels when first imported) imports them inside `load`. `requires` is what it needs of the call,
    `accepts(*args)` what it needs of its inputs (why not, None when it takes them). `borrows` names
    the helpers of other families it runs inside its own work, as (family, helper) pairs
    (`Family.helpers`): the registry loads it as ``load(helper=function, ...)`` (`registry.load`), so a
    family's package imports neither the registry nor the family it borrows from."""

    operation: str
    family: str
    load: Callable[..., Any]
    requires: tuple[Requirement, ...] = ()
    accepts: Callable[..., str | None] | None = None
    accepts_label: str = ""
    borrows: tuple[tuple[str, str], ...] = ()

    def unmet(self, target: Target, host: Host) -> str | None:
        """Why it cannot run for `target` on `host` (None: it can)."""
        return next((r for r in (req.unmet(target, host) for req in self.requires) if r), None)


@dataclass(frozen=True)
class Operation:
    """One row: an operation and its implementations (the torch reference first)."""

    name: str
    does: str
    implementations: tuple[Implementation, ...]

    def of(self, family: str) -> Implementation | None:
        """This row's implementation in `family`, or None."""
        return next((i for i in self.implementations if i.family == family), None)


@dataclass(frozen=True)
class Family:
    """An implementation family: its implementations (one per operation it runs, the attention
    always), where ``auto`` (or a named family's fallback) may take it (on "cuda" only, or on "any"
    device), whether its kernels are compiled on first use (then worth preparing ahead of the
    first sparse step), and its `helpers`: kernels another family's implementation runs inside its
    own (named by `Implementation.operation`; not rows of the table), handed in by the registry to the
    implementations that borrow them (`Implementation.borrows`), never imported from this family's
    package."""

    name: str
    implementations: tuple[Implementation, ...]
    auto: str
    compiles: bool
    helpers: tuple[Implementation, ...] = ()

    def of(self, operation: str) -> Implementation | None:
        """Its implementation of `operation`, or None."""
        return next((i for i in self.implementations if i.operation == operation), None)

    def may_auto(self, target: Target) -> bool:
        """Whether ``auto`` may take this family for `target`."""
        return self.auto == "any" or target.device == self.auto

    def unavailable(self, target: Target, host: Host) -> str | None:
        """Why its attention cannot run for `target` (None: it can)."""
        return self.of("attention").unmet(target, host)


@dataclass(frozen=True)
class DenseKernel:
    """A dense attention kernel a family offers the measured dense choice (`dense/choice.py`), which
    times it against SDPA's kernels and the host application's own function.

    `name` keys the stored choices, `label` names it in reports; `unavailable(q)` says why it cannot
    run inputs like the [B, H, S, D] `q` here (None: it can); `installed()` whether its package is
    present (present but unable to run is said once); `attention(q, k, v)` runs exact softmax
    attention (scale head_dim ** -0.5) on [B, H, S, D] and returns q's dtype; `needs` what it needs,
    for the table; `first_call` what its first call in a process costs (said once where it is a
    candidate); `disk_cache(folder)`, where its package can keep what it compiles on disk, points it at
    `folder` (one the pack owns) before the package is first imported and returns the line said once."""

    name: str
    label: str
    unavailable: Callable[[torch.Tensor], str | None]
    installed: Callable[[], bool]
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    needs: str = ""
    first_call: str = ""
    disk_cache: Callable[[Path], str] | None = None


@dataclass(frozen=True)
class SparseKernel:
    """A block-sparse attention kernel at one arithmetic: a candidate of the measured sparse choice
    (`sparse_choice/choice.py`), which times the candidates on the real plan and keeps the fastest that
    meets the run's error bound.

    `name` keys the stored choices, `label` names it in reports; `attention` is its family's attention
    row (`load()` gives the object whose `attend_blocks(q, k, v, plan, precision)` runs it, `requires`
    what it needs); `precision` the arithmetic it runs ("bf16": the inputs' own, or "8-bit"), so a
    bf16 kernel is a candidate under both bounds and an 8-bit one under the 8-bit bound only;
    `devices` the device types it is a candidate on (the compiled families: CUDA, as ``auto`` takes them)."""

    name: str
    label: str
    attention: Implementation
    precision: str = "bf16"
    devices: tuple[str, ...] = ("cuda",)

    def unavailable(self, target: Target, host: Host) -> str | None:
        """Why it is not a candidate for `target` (its precision is this kernel's own; None: it is)."""
        if target.device not in self.devices:
            return f"it runs on {', '.join(self.devices)}, not {target.device}"
        return self.attention.unmet(replace(target, precision=self.precision), host)
