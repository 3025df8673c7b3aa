"""The QKV producer's epilogue as one Triton pass: q/k RMSNorm, split-half RoPE, q/k/v head-major.

The torch epilogue (`reference/norm_rope.py`) reads a projected chunk three times and writes it three
times (the norm and rotation of q and k in place, then one transposing copy per tensor); here one
program per (rows, head) reads its q, k and v rows once, normalises and rotates q and k in registers
and stores all three in the [1, g, S, D] layout the sparse kernels read. Same arithmetic as the
reference: the sum of squares and the scaling in fp32, the normed row rounded to x's dtype, the
rotation in the table's dtype (emulated in fp32: each operation rounded as torch rounds it). A pair's
partner (dim i +- rot_dim/2) is loaded a second time from the same cache lines rather than moved
between lanes. Importing this module imports Triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


ROWS = 16  # rows per program


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE and back: one rounding of torch's arithmetic in DTYPE, done in fp32."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _normed(X, offs, mask, inv, Scale, dims, dims_mask, T_DTYPE: tl.constexpr):
    """x * inv_rms * scale at `dims` of the rows at `offs`, rounded to x's dtype, then to the table's."""
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(Scale + dims, mask=dims_mask, other=0.0).to(tl.float32)
    return _rounded(_rounded(x * inv[:, None] * s[None, :], X.dtype.element_ty), T_DTYPE)


@triton.jit
def _norm_rope_one(X, Y, Scale, x_rows, y_rows, inside, offs_d, partner, in_dim, rotated, low, ta, tb, eps, D,
                   T_DTYPE: tl.constexpr, ROPE: tl.constexpr):
    mask = inside[:, None] & in_dim[None, :]
    x = tl.load(X + x_rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    s = tl.load(Scale + offs_d, mask=in_dim, other=0.0).to(tl.float32)
    y = _rounded(x * inv[:, None] * s[None, :], X.dtype.element_ty)
    if ROPE:  # in fp32, each product and the sum rounded to the table's dtype as torch's ops round them
        yt = _rounded(y, T_DTYPE)
        yp = _normed(X, x_rows[:, None] + partner[None, :], inside[:, None] & rotated[None, :], inv, Scale, partner,
                     rotated, T_DTYPE)
        first = tl.where(low[None, :], yt, yp)
        second = tl.where(low[None, :], yp, yt)
        rot = _rounded(_rounded(ta * first, T_DTYPE) + _rounded(tb * second, T_DTYPE), T_DTYPE)
        y = tl.where(rotated[None, :], rot, y)
    tl.store(Y + y_rows[:, None] + offs_d[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=['n', 'g', 'half', 'rot'])  # what varies between a run's chunks, head groups, models
def _norm_rope(C, Q, K, V, T, QScale, KScale, n, start, g, sc_n, so_h, so_s, st_s, half, rot, D, eps,
               HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, ROPE: tl.constexpr):
    h = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    inside = rows < n
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    in_dim = offs_d < D
    rotated = offs_d < rot
    low = offs_d < half
    partner = tl.where(low, offs_d + half, offs_d - half)
    x_rows = rows64 * sc_n + h * D  # q's columns of head h; k's are g * D further, v's 2 * g * D
    y_rows = h * so_h + (start + rows64) * so_s
    ta = tl.zeros((BLOCK_ROWS, HEAD_DIM), dtype=tl.float32)
    tb = tl.zeros((BLOCK_ROWS, HEAD_DIM), dtype=tl.float32)
    if ROPE:  # coefficients of pair element `first` (dim i) and `second` (dim i + half) for each output dim
        t_offs = rows64[:, None] * st_s + (tl.where(low, offs_d, offs_d - half) * 4 + tl.where(low, 0, 2))[None, :]
        t_mask = inside[:, None] & rotated[None, :]
        ta = tl.load(T + t_offs, mask=t_mask, other=0.0).to(tl.float32)
        tb = tl.load(T + t_offs + 1, mask=t_mask, other=0.0).to(tl.float32)
    _norm_rope_one(C, Q, QScale, x_rows, y_rows, inside, offs_d, partner, in_dim, rotated, low, ta, tb, eps, D,
                   T.dtype.element_ty, ROPE)
    _norm_rope_one(C, K, KScale, x_rows + g * D, y_rows, inside, offs_d, partner, in_dim, rotated, low, ta, tb, eps, D,
                   T.dtype.element_ty, ROPE)
    mask = inside[:, None] & in_dim[None, :]
    vals = tl.load(C + (x_rows + 2 * g * D)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    tl.store(V + y_rows[:, None] + offs_d[None, :], vals.to(V.dtype.element_ty), mask=mask)


def norm_rope_triton(chunk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                     table: torch.Tensor | None, q_scale: torch.Tensor, k_scale: torch.Tensor, eps: float) -> None:
    """`norm_rope_torch` in one launch (same arguments; `accepts` says which inputs it takes).

    Args:
        chunk: [n, 3 * g * D] with unit column stride.
        q, k, v: [1, g, S, D] with unit dim stride, one stride layout, written at rows [start, start + n).
        start: the chunk's first row; table: [1, n or 1, 1, rot_dim/2, 2, 2] (each row's 2 x 2 matrices
            contiguous) or None.
        q_scale, k_scale: [D]; eps: the RMSNorm epsilon.
    """
    n, g, D = chunk.shape[0], q.shape[1], q.shape[-1]
    if n == 0:
        return
    rope = table is not None
    t = table if rope else chunk  # an unread pointer of the chunk's dtype without a table
    half = table.shape[-3] if rope else 0
    st_s = t.stride(1) if rope and t.shape[1] > 1 else 0
    _norm_rope[(triton.cdiv(n, ROWS), g)](
        chunk, q, k, v, t, q_scale.contiguous(), k_scale.contiguous(), n, start, g, chunk.stride(0), q.stride(1),
        q.stride(2), st_s, half, 2 * half, D, eps,
        HEAD_DIM=triton.next_power_of_2(D), BLOCK_ROWS=ROWS, ROPE=rope, num_warps=4)
