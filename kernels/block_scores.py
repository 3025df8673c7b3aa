"""Triton kernel of the routing's pooled scores E = q_mean k_mean^T / sqrt(D) (`backend/routing`).

The block means are fp32; torch multiplies them by an fp32 SIMT GEMM (0.49 ms at the 10 s H3
shape on the H200: 56 heads x 1,151^2 x 128). Here one program per 64 x 64 tile of a head's
scores multiplies on tensor cores in "tf32x3" (three TF32 products that recover about fp32
accuracy) for fp32 inputs, so the routing sees the same scores up to fp32 rounding.

Importing this module imports Triton: the backend imports it only on demand.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 64  # query and key blocks per program


@triton.jit(do_not_specialize=['J'])
def _pooled_scores(Q, K, Out, J, D, scale, DP: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr):
    g = tl.program_id(2).to(tl.int64)
    i = tl.program_id(0) * TILE + tl.arange(0, TILE)
    j = tl.program_id(1) * TILE + tl.arange(0, TILE)
    d = tl.arange(0, DP)
    q = tl.load(Q + (g * J + i[:, None]) * D + d[None, :], mask=(i[:, None] < J) & (d[None, :] < D), other=0.0)
    k = tl.load(K + (g * J + j[:, None]) * D + d[None, :], mask=(j[:, None] < J) & (d[None, :] < D), other=0.0)
    e = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    tl.store(Out + (g * J + i[:, None]) * J + j[None, :], e, mask=(i[:, None] < J) & (j[None, :] < J))


def pooled_scores_triton(q_mean: torch.Tensor, k_mean: torch.Tensor) -> torch.Tensor:
    """q_mean k_mean^T / sqrt(D) of fp32 [B, H, J, D] block means: fp32 [B, H, J, J]."""
    if q_mean.shape != k_mean.shape or q_mean.dim() != 4 or {q_mean.dtype, k_mean.dtype} != {torch.float32}:
        raise ValueError(f"pooled_scores_triton: q_mean and k_mean must be fp32 [B, H, J, D] of one shape, got "
                         f"{q_mean.dtype} {tuple(q_mean.shape)} and {k_mean.dtype} {tuple(k_mean.shape)}")
    B, H, J, D = q_mean.shape
    out = torch.empty(B, H, J, J, dtype=torch.float32, device=q_mean.device)
    grid = (triton.cdiv(J, TILE), triton.cdiv(J, TILE), B * H)
    _pooled_scores[grid](q_mean.contiguous(), k_mean.contiguous(), out, J, D, D ** -0.5,
                         DP=max(16, triton.next_power_of_2(D)), TILE=TILE, PRECISION="tf32x3", num_warps=4)
    return out
