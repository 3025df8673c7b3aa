"""`BlockSparsePlan`: the tensors a block-sparse attention kernel consumes.

Like FlexAttention's BlockMask, the sparse structure is a handful of small tensors:

- q_perm, k_perm: int32 [Bp, Hp, J * block_size] tiled slot -> model-order row (destination ->
  source), -1 for padding. Bp is 1 or B, Hp is 1 or H. V follows K.
- block_len: int32 [J], valid rows of every block (valid rows come first within a block).
- dense_hi: int32 [J]; query block i attends exactly to every key block j < dense_hi[i]
  (context first in block order, so this is the "always exact" prefix).
- q2k_idx: int16 or int32 [B, H, J, R] selected key blocks (ascending, all >= dense_hi[i], -1
  padded); the planner writes int16 while J < 2**15 (half the memory: at 60 s clips this table
  is the planner's largest tensor, 5% of Q/K/V per 0.1 of ratio in int32);
  q2k_num: int32 [B, H, J], how many entries of a row are valid.
- Candidates of query block i are the key blocks in [dense_hi[i], J); the unselected ones are
  represented by tail summaries, either per query (`tail_k` [B,H,J,D] stored dtype, `tail_v`
  [B,H,J,D], `tail_bias` [B,H,J] fp32 natural-log mass bias) or once per query block
  (`block_logit` [B,H,J] fp32 log-mass, `block_value` [B,H,J,D] fp32 normalised value).
All attention terms (exact keys and summaries) share one softmax, normalised once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

EMPTY_ROW_LSE = -1.0e30  # log-sum-exp reported for a row that may attend to nothing (finite)


@dataclass
class BlockSparsePlan:
    block_size: int
    q_perm: torch.Tensor
    k_perm: torch.Tensor
    block_len: torch.Tensor
    dense_hi: torch.Tensor
    q2k_idx: torch.Tensor
    q2k_num: torch.Tensor
    tail_k: torch.Tensor | None = None
    tail_v: torch.Tensor | None = None
    tail_bias: torch.Tensor | None = None
    block_logit: torch.Tensor | None = None
    block_value: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.block_len.numel())

    def selected_mask(self, rows: slice = slice(None)) -> torch.Tensor:
        """bool [B, H, J, J]: key block j selected (by TopK) for query block i; `rows` picks
        query blocks (callers that must stay linear in J take a few at a time)."""
        idx, num = self.q2k_idx[:, :, rows], self.q2k_num[:, :, rows]
        B, H, n, R = idx.shape
        J = self.num_blocks
        mask = torch.zeros(B, H, n, J + 1, dtype=torch.bool, device=idx.device)
        valid = torch.arange(R, device=mask.device).view(1, 1, 1, R) < num.unsqueeze(-1)
        mask.scatter_(3, torch.where(valid & (idx >= 0), idx.long(), torch.full_like(idx, J).long()), True)
        return mask[..., :J]

    def allowed_mask(self, rows: slice = slice(None)) -> torch.Tensor:
        """bool [B, H, J, J]: key blocks computed exactly (dense prefix or selected)."""
        cols = torch.arange(self.num_blocks, device=self.dense_hi.device)
        return (cols.view(1, -1) < self.dense_hi[rows].view(-1, 1)) | self.selected_mask(rows)

    def summary_mask(self, rows: slice = slice(None)) -> torch.Tensor:
        """bool [B, H, J, J]: candidate key blocks that are represented by their summary."""
        cols = torch.arange(self.num_blocks, device=self.dense_hi.device)
        return (cols.view(1, -1) >= self.dense_hi[rows].view(-1, 1)) & ~self.selected_mask(rows)


def pack(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Rows of x [B, H, S, D] in tiled order [B, H, L, D] (perm [Bp, Hp, L]); padding slots are zero.

    A permutation shared by every batch and head is a plain row gather (`index_select`), much
    cheaper on the GPU than the element-wise gather that per-head permutations need."""
    B, H, S, D = x.shape
    if perm.shape[0] == 1 and perm.shape[1] == 1:
        idx = perm.view(-1)
        return x.index_select(2, idx.clamp(min=0)).masked_fill_((idx < 0).view(1, 1, -1, 1), 0)
    idx = perm.long().expand(B, H, -1)
    rows = torch.gather(x, 2, idx.clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, D))
    return rows.masked_fill((idx < 0).unsqueeze(-1), 0)


def unpack(y: torch.Tensor, perm: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Inverse of `pack`: tiled rows [B, H, L, D] back to model order [B, H, seq_len, D]."""
    B, H, L, D = y.shape
    idx = perm.long().expand(B, H, -1)
    target = torch.where(idx >= 0, idx, torch.full_like(idx, seq_len))  # padding lands in a spare row
    out = y.new_zeros(B, H, seq_len + 1, D)
    out.scatter_(2, target.unsqueeze(-1).expand(-1, -1, -1, D), y)
    return out[:, :, :seq_len]
