"""Triton kernels of the reblock tree features (`backend/reblock.metric_features`).

Sample moments: A^T A / n of a head's sampled rows (any row stride, so a strided sample of Q/K
is read in place), SPLITS programs per head whose partial sums are added in float64;
16-bit inputs on tensor cores with fp32 accumulation (torch has no 16-bit product with an fp32
result on every supported version, and an fp32 SIMT product of the samples is several times
slower). Given a factor L, the rows are first mapped to a L / |a L| and rounded to A's
dtype, the moment of the normalised metric-space rows that the feature basis comes from (in
torch: a gather, a GEMM, a norm, a division and two casts of the sample, each a pass over it).
The moments stay positive semidefinite: both operands are the same rounded rows.

Projection: every token x of a head becomes (x L W) / |x L|: its coordinates on the top principal
directions of the metric space, divided by its length in the full metric space (cosine
geometry). On the torch path that is one GEMM into a [N, D + r] buffer in the input dtype, a
norm over its first D columns, a division and a NaN clean-up, bound by moving the buffer.
Here one program per tile of rows does both
products in fp32 accumulators and writes only the r feature columns, in half precision.

Importing this module imports Triton: `family.py` imports it only when a call resolves to it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import SparseAttentionError
from .configs import dot_precision, row_align

BLOCK_M = 64  # rows per tile
TILES = 4  # tiles per program: the [D, D] and [D, r] weights are loaded once for all of them
TINY = tl.constexpr(1e-30)  # floor of the norm (as in backend/reblock.py)
GRAM_ROWS = 64  # sampled rows per product step ...
SPLITS = 4  # ... and programs per head (one per head left most SMs idle)


@triton.jit(do_not_specialize=['n', 'sa_g', 'sa_n'])
def _gram(A, L, Out, n, D, sa_g, sa_n, DP: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
          NORMALISE: tl.constexpr, PRECISION: tl.constexpr, ALIGN: tl.constexpr):
    g = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, DP)
    dmask = d < D
    if NORMALISE:
        factor = tl.load(L + g * D * D + d[:, None] * D + d[None, :], mask=dmask[:, None] & dmask[None, :], other=0.0)
    acc = tl.zeros([DP, DP], tl.float32)
    for start in range(tl.program_id(0) * BLOCK, n, SPLITS * BLOCK):
        rows = start + tl.arange(0, BLOCK)
        arow = tl.multiple_of(g * sa_g + rows.to(tl.int64) * sa_n, ALIGN)  # ALIGN: as in `_metric_project`
        a = tl.load(A + arow[:, None] + d[None, :], mask=(rows[:, None] < n) & dmask[None, :], other=0.0)
        if NORMALISE:
            s = tl.dot(a, factor, input_precision=PRECISION)
            a = (s / (tl.sqrt(tl.sum(s * s, 1))[:, None] + TINY)).to(A.dtype.element_ty)
        acc += tl.dot(tl.trans(a), a, input_precision=PRECISION)
    out = Out + (g * SPLITS + tl.program_id(0)) * D * D
    tl.store(out + d[:, None] * D + d[None, :], acc / n, mask=dmask[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=['N', 'sx_g', 'sx_n'])
def _metric_project(X, L, P, Out, N, D, sx_g, sx_n, R: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                    TILES: tl.constexpr, PRECISION: tl.constexpr, ALIGN: tl.constexpr):
    g = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, DP)
    rr = tl.arange(0, R)
    dmask = d < D
    factor = tl.load(L + g * D * D + d[:, None] * D + d[None, :], mask=dmask[:, None] & dmask[None, :], other=0.0)
    proj = tl.load(P + g * D * R + d[:, None] * R + rr[None, :], mask=dmask[:, None], other=0.0)
    for t in tl.static_range(TILES):
        rows = (tl.program_id(0) * TILES + t) * BLOCK + tl.arange(0, BLOCK)
        live = rows < N
        # the head and row strides are not specialised (they change with the clip length); ALIGN
        # (`configs.row_align`) divides both, so rows are still read in vectors, not element by element
        xrow = tl.multiple_of(g * sx_g + rows.to(tl.int64) * sx_n, ALIGN)
        x = tl.load(X + xrow[:, None] + d[None, :], mask=live[:, None] & dmask[None, :], other=0.0)
        full = tl.dot(x, factor, input_precision=PRECISION)
        norm = tl.sqrt(tl.sum(full * full, 1))
        f = tl.dot(x, proj, input_precision=PRECISION) / (norm[:, None] + TINY)
        f = tl.where(tl.abs(f) < float("inf"), f, 0.0)  # NaN and +-inf -> 0, as nan_to_num(0, 0, 0)
        tl.store(Out + (g * N + rows[:, None]) * R + rr[None, :], f.to(Out.dtype.element_ty), mask=live[:, None])


def gram_triton(a: torch.Tensor, factor: torch.Tensor | None = None) -> torch.Tensor:
    """a^T a / n per head of a [G, n, D] (fp16/bf16/fp32, any row and head strides): float64
    [G, D, D]. With factor [G, D, D] (rounded to a's dtype) the rows are first a L / (|a L| + tiny),
    rounded to a's dtype."""
    G, n, D = a.shape
    if factor is not None and (factor.shape != (G, D, D) or not factor.is_floating_point()):
        raise SparseAttentionError(f"gram_triton: factor must be a floating [G, D, D], got {factor.dtype} {tuple(factor.shape)}")
    factor = None if factor is None else factor.to(a.dtype)
    if a.stride(-1) != 1:
        a = a.contiguous()
    out = torch.empty(G, SPLITS, D, D, dtype=torch.float32, device=a.device)
    _gram[(SPLITS, G)](a, a if factor is None else factor.contiguous(), out, n, D, a.stride(0), a.stride(1),
                       DP=max(16, triton.next_power_of_2(D)), BLOCK=GRAM_ROWS, SPLITS=SPLITS,
                       NORMALISE=factor is not None, PRECISION=dot_precision(a.dtype), ALIGN=row_align(a),
                       num_warps=8)
    return out.double().sum(1)


def metric_project_triton(x: torch.Tensor, factor: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """(x @ proj) / (|x @ factor| + tiny) per row, non-finite entries 0: fp16 [G, N, r] (the tree's
    feature storage, `backend/reblock.feature_dtype`).

    x [G, N, D] fp16/bf16/fp32, any row and head strides (no copy of a strided view of Q/K);
    factor [G, D, D] and proj [G, D, r], rounded to x's dtype (r a power of two, at least 16). Products
    accumulate in fp32 (full fp32 for fp32 inputs).
    """
    G, N, D = x.shape
    r = proj.shape[-1]
    if factor.shape != (G, D, D) or proj.shape != (G, D, r) or not (factor.is_floating_point() and proj.is_floating_point()):
        raise SparseAttentionError(f"metric_project_triton: factor must be a floating [G, D, D] and proj [G, D, r], "
                         f"got {factor.dtype} {tuple(factor.shape)} and {proj.dtype} {tuple(proj.shape)}")
    factor, proj = factor.to(x.dtype), proj.to(x.dtype)
    if r < 16 or r & (r - 1):
        raise SparseAttentionError(f"metric_project_triton: r={r} is not allowed: expected a power of two >= 16")
    if x.stride(-1) != 1:
        x = x.contiguous()  # rows may be strided (a head's slice of Q/K is), their elements not
    out = torch.empty(G, N, r, dtype=torch.float16, device=x.device)
    grid = (triton.cdiv(N, BLOCK_M * TILES), G)
    _metric_project[grid](x, factor.contiguous(), proj.contiguous(), out, N, D, x.stride(0), x.stride(1), R=r,
                          DP=max(16, triton.next_power_of_2(D)), BLOCK=BLOCK_M, TILES=TILES,
                          PRECISION=dot_precision(x.dtype), ALIGN=row_align(x), num_warps=4)
    return out
