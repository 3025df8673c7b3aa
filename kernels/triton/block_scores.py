"""Triton kernels of the routing's pooled scores E = q_mean k_mean^T / sqrt(D) (`backend/routing`).

The block means are fp32; torch multiplies them by an fp32 SIMT GEMM, which leaves the tensor
cores idle. Here one program per 64 x 64 tile of a head's
scores multiplies on tensor cores in "tf32x3" (three TF32 products that recover about fp32
accuracy) for fp32 inputs, so the routing sees the same scores up to fp32 rounding.

Either kernel writes any tile-aligned window of rows and columns of E (the routing streams E
through a bounded buffer in chunks of query blocks): a window's tiles are the full matrix's
tiles, so every score is bit for bit the one the full matrix holds. The 8-bit kernel multiplies
quantised block means (`backend/indexer.py`): int8 codes with exact int32 accumulation, or fp8
e4m3 codes with fp32 accumulation, then the per-row scales.

Importing this module imports Triton: `family.py` imports it only when a call resolves to it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import SparseAttentionError

TILE = 64  # query and key blocks per program; windows start at multiples of it

_WINDOW = ['J', 'i0', 'c0', 'n_rows', 'n_cols']  # lengths and offsets: no recompilation per clip


@triton.jit(do_not_specialize=_WINDOW)
def _pooled_scores(Q, K, Out, J, D, i0, c0, n_rows, n_cols, scale, DP: tl.constexpr, TILE: tl.constexpr,
                   PRECISION: tl.constexpr):
    g = tl.program_id(2).to(tl.int64)
    r = tl.program_id(0) * TILE + tl.arange(0, TILE)  # rows and columns of the window
    c = tl.program_id(1) * TILE + tl.arange(0, TILE)
    d = tl.arange(0, DP)
    q = tl.load(Q + (g * J + i0 + r[:, None]) * D + d[None, :], mask=(r[:, None] < n_rows) & (d[None, :] < D),
                other=0.0)
    k = tl.load(K + (g * J + c0 + c[:, None]) * D + d[None, :], mask=(c[:, None] < n_cols) & (d[None, :] < D),
                other=0.0)
    e = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    tl.store(Out + (g * n_rows + r[:, None]) * n_cols + c[None, :], e, mask=(r[:, None] < n_rows) & (c[None, :] < n_cols))


@triton.jit(do_not_specialize=_WINDOW)
def _quantised_scores(Q, QScale, K, KScale, Out, J, i0, c0, n_rows, n_cols, DP: tl.constexpr,
                      TILE: tl.constexpr, INT8: tl.constexpr):
    g = tl.program_id(2).to(tl.int64)
    r = tl.program_id(0) * TILE + tl.arange(0, TILE)
    c = tl.program_id(1) * TILE + tl.arange(0, TILE)
    d = tl.arange(0, DP)
    rin, cin = r < n_rows, c < n_cols
    # rows and columns outside the window load nothing (no fp8 fill value exists) and are not stored
    q = tl.load(Q + (g * J + i0 + r[:, None]) * DP + d[None, :], mask=rin[:, None])
    k = tl.load(K + (g * J + c0 + c[:, None]) * DP + d[None, :], mask=cin[:, None])
    if INT8:
        acc = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)  # exact: |sum| < 2**24
    else:
        acc = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
    qs = tl.load(QScale + g * J + i0 + r, mask=rin, other=0.0)
    ks = tl.load(KScale + g * J + c0 + c, mask=cin, other=0.0)
    e = acc * qs[:, None] * ks[None, :]  # (acc * qs) * ks, the torch path's order
    tl.store(Out + (g * n_rows + r[:, None]) * n_cols + c[None, :], e, mask=rin[:, None] & cin[None, :])


def _window(J: int, rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> tuple[int, int, int, int]:
    (i0, i1), (c0, c1) = rows or (0, J), cols or (0, J)
    if not (0 <= i0 < i1 <= J and 0 <= c0 < c1 <= J and i0 % TILE == 0 and c0 % TILE == 0):
        raise SparseAttentionError(f"block scores: window rows={rows}, cols={cols} is not allowed: expected ranges inside "
                         f"[0, {J}) starting at multiples of {TILE}")
    return i0, i1, c0, c1


def pooled_scores_triton(q_mean: torch.Tensor, k_mean: torch.Tensor, rows: tuple[int, int] | None = None,
                         cols: tuple[int, int] | None = None) -> torch.Tensor:
    """q_mean k_mean^T / sqrt(D) of fp32 [B, H, J, D] block means: fp32 [B, H, i1 - i0, c1 - c0],
    the window rows = (i0, i1), cols = (c0, c1) of the [B, H, J, J] matrix (default: all of it)."""
    if q_mean.shape != k_mean.shape or q_mean.dim() != 4 or {q_mean.dtype, k_mean.dtype} != {torch.float32}:
        raise SparseAttentionError(f"pooled_scores_triton: q_mean and k_mean must be fp32 [B, H, J, D] of one shape, got "
                         f"{q_mean.dtype} {tuple(q_mean.shape)} and {k_mean.dtype} {tuple(k_mean.shape)}")
    B, H, J, D = q_mean.shape
    i0, i1, c0, c1 = _window(J, rows, cols)
    out = torch.empty(B, H, i1 - i0, c1 - c0, dtype=torch.float32, device=q_mean.device)
    grid = (triton.cdiv(i1 - i0, TILE), triton.cdiv(c1 - c0, TILE), B * H)
    _pooled_scores[grid](q_mean.contiguous(), k_mean.contiguous(), out, J, D, i0, c0, i1 - i0, c1 - c0, D ** -0.5,
                         DP=max(16, triton.next_power_of_2(D)), TILE=TILE, PRECISION="tf32x3", num_warps=4)
    return out


def quantised_scores_triton(q_codes: torch.Tensor, q_scale: torch.Tensor, k_codes: torch.Tensor,
                            k_scale: torch.Tensor, rows: tuple[int, int] | None = None,
                            cols: tuple[int, int] | None = None) -> torch.Tensor:
    """Window of (q_codes k_codes^T * q_scale) * k_scale: codes int8 or float8_e4m3fn [B, H, J, D]
    (D a power of two >= 32), scales fp32 [B, H, J]; fp32 [B, H, i1 - i0, c1 - c0] (see
    `pooled_scores_triton`)."""
    fmt = {q_codes.dtype, k_codes.dtype}
    if q_codes.shape != k_codes.shape or q_codes.dim() != 4 or fmt not in ({torch.int8}, {torch.float8_e4m3fn}):
        raise SparseAttentionError(f"quantised_scores_triton: codes must be int8 or float8_e4m3fn [B, H, J, D] of one shape "
                         f"and dtype, got {q_codes.dtype} {tuple(q_codes.shape)} and {k_codes.dtype} "
                         f"{tuple(k_codes.shape)}")
    B, H, J, D = q_codes.shape
    if D < 32 or D & (D - 1):
        raise SparseAttentionError(f"quantised_scores_triton: head_dim={D} is not allowed: expected a power of two >= 32")
    for name, s in (("q_scale", q_scale), ("k_scale", k_scale)):
        if s.shape != (B, H, J) or s.dtype != torch.float32:
            raise SparseAttentionError(f"quantised_scores_triton: {name} must be fp32 [{B}, {H}, {J}], got {s.dtype} "
                             f"{tuple(s.shape)}")
    i0, i1, c0, c1 = _window(J, rows, cols)
    out = torch.empty(B, H, i1 - i0, c1 - c0, dtype=torch.float32, device=q_codes.device)
    grid = (triton.cdiv(i1 - i0, TILE), triton.cdiv(c1 - c0, TILE), B * H)
    _quantised_scores[grid](q_codes.contiguous(), q_scale.contiguous(), k_codes.contiguous(), k_scale.contiguous(),
                            out, J, i0, c0, i1 - i0, c1 - c0, DP=D, TILE=TILE,
                            INT8=q_codes.dtype == torch.int8, num_warps=4)
    return out
