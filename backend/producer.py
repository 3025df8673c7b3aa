"""Chunked Q/K/V production from an H3 attention layer's own weights.

H3's attention projects the block input with one fused ``qkv_proj`` ([S, 3*H*D], no bias),
applies a per-head RMSNorm to q and k and then split-half RoPE on the first ``rot_dim`` dims of
each head (pair i is dims i and i + rot_dim/2; the rotation table is [1, S, 1, rot_dim/2, 2, 2]
of [[cos, -sin], [sin, cos]]). Here the same maths runs over chunks of rows and writes straight
into head-major q, k, v [1, g, S, D], the layout the sparse kernel reads, so the full fused
[S, 3*H*D] buffer and the model's v copy never exist. A head subset [h0, h1) can be produced on
its own (low-VRAM head groups): its weight rows are sliced out of the fused projection.

The projection is either a plain weight or a `Projection`: an object that hands out, once per
head group, the function that multiplies a chunk of rows for that group. The node side builds one
that goes through the layer's own (possibly quantised) matmul, so the checkpoint's format decides
the arithmetic; here the producer only decides the rows and the heads.

The epilogue (q/k RMSNorm, split-half RoPE, the head-major layout) is the table's `norm_rope` row: one
Triton pass on a GPU, the torch reference (`kernels/reference/norm_rope.py`, comfy-kitchen's arithmetic)
by default. Rows are produced in model order: the tiling's permutation is applied by the kernel's
indexed loads, not by gathering rows before the projection.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from ..errors import SparseAttentionError
from ..kernels.reference.norm_rope import norm_rope_torch

CHUNK_ROWS = 4096  # rows per projection chunk: 4096 x 3 x 7168 bf16 = 176 MB at H3's width
NormRope = Callable[..., None]  # (chunk, q, k, v, start, table, q_scale, k_scale, eps), `norm_rope_torch`'s


def head_rows(t: torch.Tensor, num_heads: int, head_dim: int, heads: tuple[int, int]) -> torch.Tensor:
    """Rows of a fused [3*H*D, ...] projection weight (or bias) that produce heads [h0, h1) of q, k, v."""
    h0, h1 = heads
    if (h0, h1) == (0, num_heads):
        return t
    return t.reshape(3, num_heads, head_dim, *t.shape[1:])[:, h0:h1].reshape(3 * (h1 - h0) * head_dim, *t.shape[1:])


class Projection(Protocol):
    """The fused qkv projection of a layer, handed out per head group."""

    def for_heads(self, heads: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The function that maps rows [n, hidden] to the projection's columns of q, k, v for
        heads [h0, h1), [n, 3*(h1 - h0)*D]. Called once per head group per call, never per chunk."""
        ...


@dataclass(frozen=True)
class WeightProjection:
    """A plain (float) fused weight [3*H*D, hidden] and bias: the head group's rows sliced once."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    num_heads: int
    head_dim: int

    def for_heads(self, heads: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
        w = head_rows(self.weight, self.num_heads, self.head_dim, heads)
        b = None if self.bias is None else head_rows(self.bias, self.num_heads, self.head_dim, heads)
        return lambda rows: F.linear(rows, w, b)


def produce_qkv(x: torch.Tensor, weight: torch.Tensor | Projection, bias: torch.Tensor | None, num_heads: int,
                head_dim: int, q_scale: torch.Tensor, k_scale: torch.Tensor, eps: float, rope: torch.Tensor | None,
                heads: tuple[int, int] | None = None, chunk_rows: int = CHUNK_ROWS,
                norm_rope: NormRope | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """H3's q, k, v of block input x, produced in chunks of rows straight into the kernel's layout.

    Args:
        x: the block's attention input [S, hidden].
        weight, bias: the fused qkv projection's ([3*H*D, hidden], [3*H*D] or None), already in
            x's dtype and device; or weight a `Projection` (then bias must be None).
        num_heads, head_dim: H and D of the layer.
        q_scale, k_scale, eps: the q/k RMSNorm weights [D] and epsilon.
        rope: H3's rotation table, or None for no RoPE.
        heads: the head range [h0, h1) to produce (default: all), e.g. one low-VRAM head group.
        chunk_rows: rows projected at a time, so the fused [S, 3*H*D] output never exists whole.
        norm_rope: the epilogue of each projected chunk (the resolved `Kernels.norm_rope`); default
            the torch reference.
    Returns:
        q, k, v [1, h1 - h0, S, D] in x's dtype, model order.
    """
    if x.dim() != 2:
        raise SparseAttentionError(f"produce_qkv: x must be [S, hidden], got shape {tuple(x.shape)}")
    if not isinstance(weight, torch.Tensor):
        if bias is not None:
            raise SparseAttentionError("produce_qkv: bias must be None when weight is a Projection (it owns its bias)")
    elif weight.shape[0] != 3 * num_heads * head_dim:
        raise SparseAttentionError(f"produce_qkv: weight has {weight.shape[0]} rows, expected 3*{num_heads}*{head_dim}")
    h0, h1 = (0, num_heads) if heads is None else heads
    if not 0 <= h0 < h1 <= num_heads:
        raise SparseAttentionError(f"produce_qkv: heads={heads} must satisfy 0 <= h0 < h1 <= {num_heads}")
    if chunk_rows < 1:
        raise SparseAttentionError(f"produce_qkv: chunk_rows={chunk_rows} must be >= 1")
    g, S = h1 - h0, x.shape[0]
    plain = isinstance(weight, torch.Tensor)
    project = (WeightProjection(weight, bias, num_heads, head_dim) if plain else weight).for_heads((h0, h1))
    q, k, v = (x.new_empty(1, g, S, head_dim) for _ in range(3))
    epilogue = norm_rope_torch if norm_rope is None else norm_rope
    for a in range(0, S, chunk_rows):
        e = min(S, a + chunk_rows)
        epilogue(project(x[a:e]), q, k, v, a, None if rope is None else rope[:, a:e], q_scale, k_scale, eps)
    return q, k, v
