"""The `triton` family's rows: the fused attention kernel (through its custom op) and the planner's kernels.

A kernel module is imported inside its row's `load`, when a call resolves to it, never with the
package (importing the package needs no Triton, and Triton decorates a kernel when first imported).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..arch import CONFIGS
from ..vocabulary import (Family, Host, Implementation, Requirement, SparseKernel, Target, dtype_in, float32_inputs,
                          head_dim_in)
from .configs import TRITON_DTYPES
from .op import TritonAttention, add_tail, triton_tiled_pack

MIN_CAPABILITY = (8, 0)  # the kernels' 16-bit tensor-core paths and shared-memory plans start at Ampere


def _device(t: Target, host: Host) -> str | None:
    if not host.has("triton"):
        return "Triton is not installed"
    if t.device != "cuda" and not host.interpret:
        return f"the tensors are on {t.device}, and Triton runs on CUDA (or on CPU with TRITON_INTERPRET=1)"
    if t.device == "cuda" and t.capability is not None and tuple(t.capability) < MIN_CAPABILITY:
        return (f"sm{t.capability[0]}{t.capability[1]} is older than the Triton kernels' "
                f"sm{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}")
    return None


REQUIRES = (Requirement(f"CUDA sm{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}+ (or CPU under TRITON_INTERPRET=1), "
                        "Triton installed", _device, ("triton",)), dtype_in(TRITON_DTYPES))
ATTENTION_REQUIRES = REQUIRES + (head_dim_in(tuple(sorted({d for _, d, _ in CONFIGS}))),)


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


def _epilogue_inputs(chunk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                     table: torch.Tensor | None, q_scale: torch.Tensor, k_scale: torch.Tensor, eps: float
                     ) -> str | None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (chunk, table, q_scale, k_scale)):
        return "the inputs need gradients, and the kernel has no backward"
    if chunk.stride(-1) != 1 or q.stride(-1) != 1 or not q.stride() == k.stride() == v.stride():
        return (f"strides chunk {chunk.stride()}, q {q.stride()}, k {k.stride()}, v {v.stride()}: the kernel takes "
                "unit column strides and one layout for q, k, v")
    if table is not None and (table.dtype not in TRITON_DTYPES or table.stride()[3:] != (4, 2, 1)):
        return (f"a {table.dtype} rotation table with strides {table.stride()} (the kernel takes "
                f"{', '.join(str(d) for d in TRITON_DTYPES)} with each row's 2 x 2 matrices contiguous)")
    return None


def _norm_rope() -> Any:
    from . import norm_rope
    return norm_rope


def _stats() -> Any:
    from . import block_stats
    return block_stats


def _scores() -> Any:
    from . import block_scores
    return block_scores


def _select() -> Any:
    from . import block_select
    return block_select


def _mass() -> Any:
    from . import block_mass
    return block_mass


def _features() -> Any:
    from . import reblock_features
    return reblock_features


def _split() -> Any:
    from . import reblock_split
    return reblock_split


def _triton(operation: str, load: Callable[[], Callable], accepts: Callable[..., str | None] | None = None,
            label: str = "") -> Implementation:
    return Implementation(operation, "triton", load, REQUIRES, accepts, label)


ATTENTION = Implementation("attention", "triton", TritonAttention, ATTENTION_REQUIRES)
TRITON_BF16 = SparseKernel("triton", "Triton bf16", ATTENTION)  # candidates of the measured sparse choice
TRITON_8BIT = SparseKernel("triton-8bit", "Triton 8-bit", ATTENTION, precision="8-bit")

TRITON = Family("triton", (
    _triton("norm_rope", lambda: _norm_rope().norm_rope_triton, _epilogue_inputs,
            "no gradients, unit column strides, a contiguous float16/bfloat16/float32 table"),
    _triton("block_sums", lambda: _stats().block_sums_triton),
    _triton("block_summaries", lambda: _stats().block_summaries_triton),
    _triton("pooled_scores", lambda: _scores().pooled_scores_triton, float32_inputs("block means"), "float32 means"),
    _triton("quantised_scores", lambda: _scores().quantised_scores_triton),
    _triton("select_blocks", lambda: _select().select_blocks_triton, float32_inputs("routing scores"),
            "float32 scores"),
    _triton("block_log_mass", lambda: _mass().block_log_mass_triton, _mass_inputs,
            "probes and block size powers of two >= 16"),
    _triton("top_share", lambda: _mass().top_share_triton, float32_inputs("log-masses"), "float32"),
    _triton("metric_gram", lambda: _features().gram_triton, _feature_rank, "head_dim >= 16"),
    _triton("metric_project", lambda: _features().metric_project_triton, _projection_rank,
            "rank a power of two >= 16"),
    _triton("partition_level", lambda: _split().partition_level_triton),
    ATTENTION,
), auto="cuda", compiles=True, helpers=(  # what the cuDNN attention borrows (custom ops, `op.py`)
    _triton("tiled_pack", lambda: triton_tiled_pack),
    _triton("add_tail", lambda: add_tail),
))
