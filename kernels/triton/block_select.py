"""Fused Triton TopK of key blocks: one program per (batch * head, query block) and group.

`backend/routing.select_blocks` sorts every row of pooled scores to keep the `budget` largest
(ties toward the lower block index) and sorts the picks again into ascending order. Here one
program holds a row of a group's scores in registers and picks its `budget` largest by a radix
select (`radix_select.top_k_mask_pair`: exact, ties toward the lower index, no sort); the picks are
written in ascending order at their prefix-sum positions, so the selection is exactly that of
the stable sort (tested against it).

Importing this module imports Triton: `family.py` imports it only when a call resolves to it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import SparseAttentionError
from .radix_select import row_split, top_k_mask_pair


@triton.jit(do_not_specialize=['J', 'R', 'lo', 'n', 'budget', 'col0', 'i0', 'n_rows', 'n_cols', 'c0'])
def _select_group(Scores, DenseHi, Out, J, R, lo, n, budget, col0, i0, n_rows, n_cols, c0, HEAD: tl.constexpr,
                  TAIL: tl.constexpr):
    r = tl.program_id(0)  # row of the score window; query block i0 + r
    bh = tl.program_id(1)
    i = i0 + r
    row = bh.to(tl.int64) * J + i
    score_row = Scores + (bh.to(tl.int64) * n_rows + r) * n_cols + (lo - c0)
    offs = tl.arange(0, HEAD)
    live = offs < n
    out_row = Out + row * R + col0
    if tl.load(DenseHi + i) >= J:  # a dense query block: no picks
        for start in range(0, budget, HEAD):
            tl.store(out_row + start + offs, -1, mask=start + offs < budget)
    else:
        x = tl.load(score_row + offs, mask=live, other=0.0)
        tail = HEAD + tl.arange(0, TAIL)  # lanes HEAD.. of the row in a short second vector
        live_t = tail < n
        y = tl.load(score_row + tail, mask=live_t, other=0.0)
        pick, pick_t = top_k_mask_pair(x, live, y, live_t, budget)
        pos_t = tl.sum(pick.to(tl.int32), 0) + tl.cumsum(pick_t.to(tl.int32), 0) - 1
        tl.store(out_row + pos_t, (lo + tail).to(Out.dtype.element_ty), mask=pick_t)
        pos = tl.cumsum(pick.to(tl.int32), 0) - 1
        tl.store(out_row + pos, (lo + offs).to(Out.dtype.element_ty), mask=pick)


def select_blocks_triton(scores: torch.Tensor, dense_hi: torch.Tensor, groups: list[tuple[int, int, int]],
                         out: torch.Tensor | None = None, i0: int = 0, c0: int = 0) -> torch.Tensor:
    """q2k_idx [B, H, J, R] int32 of `routing.select_blocks`: per group (lo, hi, budget) the
    budget best key blocks of [lo, hi) for every sparse query block (dense_hi < J), ascending;
    rows of dense query blocks are -1. R is the sum of the budgets.

    `scores` [B, H, n_rows, n_cols] may be a window of the [B, H, J, J] matrix: rows of query
    blocks i0.., columns of key blocks c0..; then only those rows of `out` (given, or allocated
    whole) are written, so the routing can stream the scores through a bounded buffer. A given
    `out` may be int16 (J < 2**15) or int32."""
    J = dense_hi.shape[0] if dense_hi.dim() == 1 else -1
    if scores.dim() != 4 or scores.dtype != torch.float32:
        raise SparseAttentionError(f"select_blocks_triton: scores must be fp32 [B, H, rows, columns], got {scores.dtype} "
                         f"{tuple(scores.shape)}")
    B, H, n_rows, n_cols = scores.shape
    if J < 0 or not (0 <= i0 and i0 + n_rows <= J and 0 <= c0 and c0 + n_cols <= J):
        raise SparseAttentionError(f"select_blocks_triton: dense_hi must be [J] with the score window (rows {i0}+{n_rows}, "
                         f"columns {c0}+{n_cols}) inside [0, J), got dense_hi {tuple(dense_hi.shape)}")
    for lo, hi, budget in groups:
        if not (c0 <= lo < hi <= c0 + n_cols and 1 <= budget <= hi - lo):
            raise SparseAttentionError(f"select_blocks_triton: group (lo={lo}, hi={hi}, budget={budget}) is not allowed: "
                             f"expected {c0} <= lo < hi <= {c0 + n_cols} and 1 <= budget <= hi - lo")
    R = sum(budget for _, _, budget in groups)
    scores, dense_hi = scores.contiguous(), dense_hi.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(B, H, J, R, dtype=torch.int32, device=scores.device)
    elif (out.shape != (B, H, J, R) or out.dtype not in (torch.int16, torch.int32) or not out.is_contiguous()
            or (out.dtype == torch.int16 and J >= 2 ** 15)):
        raise SparseAttentionError(f"select_blocks_triton: out must be contiguous int16 (J < 2**15) or int32 "
                         f"[{B}, {H}, {J}, {R}], got {out.dtype} {tuple(out.shape)}")
    col0 = 0
    for lo, hi, budget in groups:  # about 32 scores per thread: more warps were no faster on rows of
        # about a thousand blocks
        head, tail = row_split(hi - lo)
        _select_group[(n_rows, B * H)](scores, dense_hi, out, J, R, lo, hi - lo, budget, col0, i0, n_rows, n_cols, c0,
                                       HEAD=head, TAIL=tail, num_warps=max(1, min(8, head // 1024)))
        col0 += budget
    return out
