"""The one dispatch: `SparseConfig.backend` -> the implementation every kernel of a call runs.

A backend is one row of `BACKENDS`: a name, a priority for ``auto``, and an availability check
on (device, dtype, head_dim, block_size). The chosen name travels through the whole call: the
planner's kernels (pooling, scores, TopK, summaries, reblock levels) and the attention kernel all
run on it, so ``torch`` means the pure-torch reference everywhere and ``triton`` means the Triton
kernels everywhere (under ``TRITON_INTERPRET=1`` also on CPU tensors, which is how CI runs them).
``cudnn`` (optional package, `cudnn_attention.py`) runs the exact keys on cuDNN-frontend's
block-sparse kernel and everything else on Triton; it is taken only when asked for by name.
``auto`` takes the first available backend by priority among those it may take (on CUDA only). A backend asked for by
name that cannot run raises in strict mode and otherwise runs the next available backend by
priority (in the end the torch reference), saying so once (still sparse).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from .cudnn_attention import cudnn_unavailable_reason
from .plan import BlockSparsePlan
from .reference import block_sparse_reference

log = logging.getLogger("adaptive_sparse_attention")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_warned: set[str] = set()


def triton_unavailable_reason(device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None,
                              block_size: int | None = None) -> str | None:
    """Why the Triton kernels cannot run on `device` for `dtype` (None: any dtype), or None when they can
    (every head_dim and block_size the config allows)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the tensors are on {device.type}, and Triton runs on CUDA (or on CPU with TRITON_INTERPRET=1)"
    if dtype is not None and dtype not in TRITON_DTYPES:
        return f"dtype {dtype} is not supported by the Triton kernels (expected one of " \
               f"{', '.join(str(d) for d in TRITON_DTYPES)})"
    return None


def _triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    from .custom_op import block_sparse_op

    return block_sparse_op(q, k, v, plan)


def _cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    from .custom_op import block_sparse_op

    return block_sparse_op(q, k, v, plan, "cudnn")


@dataclass(frozen=True)
class Backend:
    """One implementation of every kernel: `unavailable(device, dtype, head_dim, block_size)` says why it
    cannot run (None: it can)."""

    name: str
    priority: int  # lower runs first under "auto"
    unavailable: Callable[[torch.device, torch.dtype, int | None, int | None], str | None]
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, BlockSparsePlan], tuple[torch.Tensor, torch.Tensor]]
    auto: str  # where "auto" (and the fallback of a named backend) may pick it: "never", "cuda" or "any" device

    def may_auto(self, device: torch.device) -> bool:
        """Whether "auto" may pick this backend for tensors on `device`."""
        return self.auto == "any" or (self.auto == "cuda" and device.type == "cuda")


BACKENDS: dict[str, Backend] = {
    # opt-in: it has not reached the 1.3x over Triton that taking it automatically requires (BENCHMARKS.md)
    "cudnn": Backend("cudnn", 0, cudnn_unavailable_reason, _cudnn_attention, auto="never"),
    "triton": Backend("triton", 1, triton_unavailable_reason, _triton_attention, auto="cuda"),
    "torch": Backend("torch", 2, lambda *_: None, block_sparse_reference, auto="any"),
}


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, strict: bool = False,
                    head_dim: int | None = None, block_size: int | None = None) -> str:
    """The backend that runs a call on `device` with `dtype`.

    Args:
        requested: "auto" or a name in `BACKENDS`.
        device, dtype: of the call's Q/K/V.
        strict: a named backend that cannot run raises instead of running the next one by priority.
        head_dim, block_size: of the call (None: not known yet; any value is assumed to fit).
    Returns:
        A name in `BACKENDS`.
    """
    if requested == "auto":
        for backend in sorted(BACKENDS.values(), key=lambda b: b.priority):
            if backend.may_auto(device) and backend.unavailable(device, dtype, head_dim, block_size) is None:
                return backend.name
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is not allowed: expected 'auto' or one of "
                         + ", ".join(repr(n) for n in BACKENDS))
    reason = BACKENDS[requested].unavailable(device, dtype, head_dim, block_size)
    if reason is None:
        return requested
    message = f"backend={requested!r} cannot run: {reason}"
    if strict:
        raise RuntimeError(message + " (strict mode)")
    instead = next(b for b in sorted(BACKENDS.values(), key=lambda b: b.priority)
                   if b.priority > BACKENDS[requested].priority and b.may_auto(device)
                   and b.unavailable(device, dtype, head_dim, block_size) is None)
    if message not in _warned:
        _warned.add(message)
        what = "the torch reference kernels" if instead.name == "torch" else f"backend={instead.name!r}"
        log.warning("%s; using %s instead (still sparse)", message, what)
    return instead.name


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                           backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, S, D] in q's dtype and model order, lse [B, H, S] natural log) of q, k, v under
    `plan`, on the named backend (a name `resolve_backend` returned)."""
    if backend not in BACKENDS:
        raise ValueError(f"block_sparse_attention: backend={backend!r} is not allowed: expected one of "
                         + ", ".join(repr(n) for n in BACKENDS))
    return BACKENDS[backend].attention(q, k, v, plan)


def runs_triton(backend: str) -> bool:
    """Whether the planner's kernels of a call on `backend` are the Triton ones."""
    return backend in ("triton", "cudnn")
