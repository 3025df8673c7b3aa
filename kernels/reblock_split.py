"""Fused Triton step of the reblock tree: split every node by capacity and move its slots.

`backend/reblock.partition` splits each node of a level so that the left child takes the
`left` smallest projections (ties by slot) and then moves features and token ids to the two
children with a scatter, a static index map and three gathers (about ten kernels over every
slot of the level). Here one program per (tree, node) holds the node's projections in
registers, picks the `left` smallest by a radix select (`radix_select.top_k_mask` on the negated
projections: exact, ties by slot, no sort) and writes every token's id and feature rows straight
to its slot in the next level. Nodes up to `MAX_WIDTH` slots fit one
program; the widest, first levels stay on the torch path. Same destinations as the torch split
(tested against it), so both paths give the same tiling.

Importing this module imports Triton: the backend imports it only on demand.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .radix_select import top_k_mask

MAX_WIDTH = 8192  # slots of the widest node one program takes (32 per thread at 8 warps)


@triton.jit
def _split_move(Proj, Feats, Rows, Tokens, Left, FeatsOut, RowsOut, nodes, width, out_width,
                R: tl.constexpr, WPAD: tl.constexpr, MOVE_FEATS: tl.constexpr):
    node = tl.program_id(0)
    gn = tl.program_id(1).to(tl.int64) * nodes + node  # (tree, node) row
    offs = tl.arange(0, WPAD)
    tok = tl.load(Tokens + node)
    left = tl.load(Left + node)
    live = offs < tok
    proj = tl.load(Proj + gn * width + offs, mask=live, other=0.0)
    go_left = top_k_mask(-proj, live, left)  # the `left` smallest projections, ties by slot
    before = tl.cumsum(go_left.to(tl.int32), 0)
    # left-goers first in slot order, then the others: child 0 holds [0, left), child 1 the rest
    pos = tl.where(go_left, before - 1, offs - before)
    child = gn * 2 + tl.where(go_left, 0, 1)
    rows = tl.load(Rows + gn * width + offs, mask=live)
    tl.store(RowsOut + child * out_width + pos, rows, mask=live)
    if MOVE_FEATS:
        for i in tl.static_range(R):
            f = tl.load(Feats + (gn * R + i) * width + offs, mask=live)
            tl.store(FeatsOut + (child * R + i) * out_width + pos, f, mask=live)


def split_move_triton(proj: torch.Tensor, feats: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                      left: torch.Tensor, out_width: int, move_feats: bool
                      ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Split every node of a level and move its slots to the next level.

    proj fp32 [G, nodes, width], feats fp32 [G, nodes, r, width], rows int32 [G, nodes, width];
    tokens, left int32 [nodes] (tokens first in every node; the left child's capacity). Returns
    (features [G, 2 * nodes, r, out_width] or None without `move_feats`, rows [G, 2 * nodes,
    out_width]): child 0 of node i takes its `left` smallest projections (ties by slot), child 1
    the rest, both in slot order. Slots past a child's tokens are zero.
    """
    G, nodes, width = proj.shape
    r = feats.shape[2]
    if width > MAX_WIDTH:
        raise ValueError(f"split_move_triton: node width {width} is not allowed: at most {MAX_WIDTH}")
    if feats.shape != (G, nodes, r, width) or rows.shape != (G, nodes, width) or rows.dtype != torch.int32:
        raise ValueError(f"split_move_triton: feats must be [G, nodes, r, width] and rows int32 [G, nodes, width] "
                         f"like proj {tuple(proj.shape)}, got {tuple(feats.shape)} and {rows.dtype} {tuple(rows.shape)}")
    feats_out = feats.new_zeros(G, 2 * nodes, r, out_width) if move_feats else None
    rows_out = rows.new_zeros(G, 2 * nodes, out_width)
    wpad = triton.next_power_of_2(width)
    _split_move[(nodes, G)](proj.contiguous(), feats.contiguous(), rows.contiguous(), tokens, left,
                            feats_out if move_feats else rows_out, rows_out, nodes, width, out_width,
                            R=r, WPAD=wpad, MOVE_FEATS=move_feats, num_warps=max(1, min(8, wpad // 512)))
    return feats_out, rows_out
