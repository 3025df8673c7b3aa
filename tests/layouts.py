"""Awkward layouts and plans shared by the kernel and reference tests.

`awkward_layout`: no region length is a multiple of 16 or 64, so every region ends in an edge
block; a reference video sits between text and audio, so joint-video routes over two video key
regions. `with_empty_rows`: a plan in which some sparse query blocks keep no exact key.
`memberships`: the block of every row under one head's permutation (to rebuild attention row by
row from the definitions).
"""
from __future__ import annotations

import dataclasses

import torch

from adaptive_sparse_attention import SequenceLayout
from adaptive_sparse_attention.kernels import BlockSummaries, QuerySummaries


def awkward_layout(large: bool = False) -> SequenceLayout:
    """Text, a reference video, audio, the target video (390 rows; `large`: 1541 rows, for the GPU)."""
    if large:
        return SequenceLayout.from_segments([
            (0, 77, "text"), (77, 467, "ref_video", (3, 10, 13)), (467, 617, "audio"),
            (617, 1541, "video", (7, 12, 11))])
    return SequenceLayout.from_segments([
        (0, 37, "text"), (37, 127, "ref_video", (3, 5, 6)), (127, 180, "audio"),
        (180, 390, "video", (5, 6, 7))])


def with_empty_rows(plan, empty_tail: bool = False):
    """The plan with every third sparse query block allowed nothing exact (dense prefix 0, no picks).

    Args:
        empty_tail: also take away their summaries (block tail: no block summary; query tail: head
            0 has no summaries at all, so head 1's rows there attend to the summaries of every
            block), so that their rows attend to nothing.
    """
    J = plan.num_blocks
    sparse = torch.nonzero(plan.dense_hi < J).flatten()
    gone = torch.zeros(J, dtype=torch.bool, device=plan.dense_hi.device)
    gone[sparse[::3]] = True
    fields = dict(dense_hi=torch.where(gone, torch.zeros_like(plan.dense_hi), plan.dense_hi),
                  q2k_num=plan.q2k_num.masked_fill(gone.view(1, 1, J), 0),
                  q2k_idx=plan.q2k_idx.masked_fill(gone.view(1, 1, J, 1), -1))
    if empty_tail and isinstance(plan.tail, QuerySummaries):
        bias = plan.tail.bias.clone()
        bias[:, 0] = float("-inf")
        fields["tail"] = dataclasses.replace(plan.tail, bias=bias)
    if empty_tail and isinstance(plan.tail, BlockSummaries):
        fields["tail"] = dataclasses.replace(plan.tail, logit=plan.tail.logit.masked_fill(gone.view(1, 1, J), float("-inf")))
    return dataclasses.replace(plan, **fields)


def memberships(perm_row: torch.Tensor, block: int, seq_len: int) -> torch.Tensor:
    """Block index of every model-order row under one head's permutation (-1: a row it misses)."""
    slots = torch.nonzero(perm_row >= 0).squeeze(1)
    out = torch.full((seq_len,), -1, dtype=torch.long)
    out[perm_row[slots].long()] = slots // block
    return out
