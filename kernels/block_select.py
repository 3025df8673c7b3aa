"""Fused Triton TopK of key blocks: one program per (batch * head, query block) and group.

`backend/routing.select_blocks` sorts every row of pooled scores to keep the `budget` largest
(ties toward the lower block index) and sorts the picks again into ascending order. Here one
program holds a row of a group's scores in registers (one warp per 2,048 slots, so the counts
reduce within a warp) and finds the budget-th largest score by a radix select on its
order-preserving integer key: 32 counting passes, no sort. Every score above it is picked, and
of the scores equal to it the first ones by block index, as many as the budget still allows.
The picks are written in ascending order at their prefix-sum positions, so the selection is
exactly that of the stable sort (tested against it).

Importing this module imports Triton: the backend imports it only on demand.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _select_group(Scores, DenseHi, Out, J, R, lo, n, budget, col0,
                  NPAD: tl.constexpr):
    i = tl.program_id(0)
    bh = tl.program_id(1)
    row = bh.to(tl.int64) * J + i
    offs = tl.arange(0, NPAD)
    live = offs < n
    out_row = Out + row * R + col0
    if tl.load(DenseHi + i) >= J:  # a dense query block: no picks
        tl.store(out_row + offs, -1, mask=offs < budget)
    else:
        x = tl.load(Scores + row * J + lo + offs, mask=live, other=0.0) + 0.0  # -0.0 -> +0.0, as sort sees it
        bits = x.to(tl.int32, bitcast=True)
        # order-preserving unsigned key: set the sign bit of positives, flip every bit of negatives
        key = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
        key = tl.where(live, key, 0)  # padding lanes rank with the lowest key; never picked (below)
        one = tl.full([], 1, tl.uint32)
        thresh = tl.zeros([], tl.uint32)
        for b in tl.static_range(31, -1, -1):  # the largest t with at least `budget` keys >= t
            cand = thresh | (one << b)
            thresh = tl.where(tl.sum((live & (key >= cand)).to(tl.int32), 0) >= budget, cand, thresh)
        above = key > thresh
        tie = live & (key == thresh)
        room = budget - tl.sum(above.to(tl.int32), 0)
        pick = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= room))
        pos = tl.cumsum(pick.to(tl.int32), 0) - 1
        tl.store(out_row + pos, (lo + offs).to(tl.int32), mask=pick)


def select_blocks_triton(scores: torch.Tensor, dense_hi: torch.Tensor, groups: list[tuple[int, int, int]]
                         ) -> torch.Tensor:
    """q2k_idx [B, H, J, R] int32 of `routing.select_blocks`: per group (lo, hi, budget) the
    budget best key blocks of [lo, hi) for every sparse query block (dense_hi < J), ascending;
    rows of dense query blocks are -1. R is the sum of the budgets."""
    if scores.dim() != 4 or scores.shape[-1] != scores.shape[-2] or scores.dtype != torch.float32:
        raise ValueError(f"select_blocks_triton: scores must be fp32 [B, H, J, J], got {scores.dtype} "
                         f"{tuple(scores.shape)}")
    B, H, J, _ = scores.shape
    if dense_hi.shape != (J,):
        raise ValueError(f"select_blocks_triton: dense_hi must be [{J}], got {tuple(dense_hi.shape)}")
    for lo, hi, budget in groups:
        if not (0 <= lo < hi <= J and 1 <= budget <= hi - lo):
            raise ValueError(f"select_blocks_triton: group (lo={lo}, hi={hi}, budget={budget}) is not allowed: "
                             f"expected 0 <= lo < hi <= {J} and 1 <= budget <= hi - lo")
    R = sum(budget for _, _, budget in groups)
    scores, dense_hi = scores.contiguous(), dense_hi.to(torch.int32).contiguous()
    out = torch.empty(B, H, J, R, dtype=torch.int32, device=scores.device)
    col0 = 0
    for lo, hi, budget in groups:
        npad = triton.next_power_of_2(hi - lo)
        _select_group[(J, B * H)](scores, dense_hi, out, J, R, lo, hi - lo, budget, col0,
                                  NPAD=npad, num_warps=max(1, min(8, npad // 2048)))
        col0 += budget
    return out
