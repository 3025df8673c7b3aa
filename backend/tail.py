"""Tail summaries: what stands in for the candidate key blocks TopK did not select.

- `mean`: mean key and value of the block with a +log(n) mass bias (a block of n equal keys).
- `reweight`: weights p_j = softmax(a.k_j / sqrt(d)) at an anchor query a (the mean
  of the head's target-video queries); summary key sum p_j k_j, value sum p_j v_j, bias
  log Z(a) - a.k~/sqrt(d) computed against the key as stored (after rounding to its dtype), so
  at q = a the summary reproduces the block's exact mass and numerator.
- `coarse`: softmax(E) V-bar over all blocks, broadcast per query block and added
  after normalisation, scaled by the model's learned gate; computed only when there is a gate.
Summaries are built in fp32 (fp64 for fp64 inputs). With `block` granularity, the summaries
of a query block are reduced once, at its mean query, to one log-mass and one value.

Non-finite inputs stay local: block means are finite (`pooling.block_means`), so the anchor and
the mean summaries are; a row with a non-finite key is left out of its block's reweighted
summary, key and value (a block without a finite key gets bias -inf: no summary), so one bad
key cannot reach every query through the summaries.

Whatever grows with J x J (block logits, coarse scores) is computed in chunks of query blocks
(`pooling.row_chunks`), so planner memory stays linear in J.
"""
from __future__ import annotations

import torch

from ..kernels.plan import BlockSparsePlan, Tiling, summary_mask, unpack
from ..kernels.registry import Kernels, or_reference
from .layout import TARGET_VIDEO
from .pooling import block_means, row_chunks
from .routing import pooled_scores


def target_anchor(q_mean: torch.Tensor, tiling: Tiling) -> torch.Tensor:
    """Mean target-video query per (batch, head) [B, H, D], from the planner's block means
    q_mean [B, H, J, D] weighted by block length (the target's blocks hold exactly its rows), so
    Q is not read again for it."""
    lo, hi = tiling.blocks_of(TARGET_VIDEO)
    n = tiling.block_len[lo:hi].to(q_mean.dtype)
    return (q_mean[:, :, lo:hi] * n.view(1, 1, -1, 1)).sum(2) / n.sum()


def mean_summaries(k: torch.Tensor, v: torch.Tensor, tiling: Tiling, kernels: Kernels | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean tail summaries: every block's mean key and value with a log(n) mass bias, so a summary
    weighs as much as its n keys would if they were equal (`kernels.block_summaries`, one pass
    over K and V).

    Returns:
        (key [B,H,J,D] in k's dtype, value [B,H,J,D] in v's dtype, bias log(n) [B,H,J]).
    """
    kernels = or_reference(kernels)
    return kernels.block_summaries(k, v, tiling.k_perm, tiling.block_len, tiling.block_size, None)


def reweight_summaries(k: torch.Tensor, v: torch.Tensor, tiling: Tiling, anchor: torch.Tensor,
                       kernels: Kernels | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reweighted tail summaries: every block's key and value weighted by softmax(anchor . k /
    sqrt(D)) and its log-mass bias, so a query at the anchor gets the block's exact mass and
    numerator from one column (`kernels.block_summaries`).

    Args:
        k, v: [B, H, S, D], model order; tiling: their block layout (`k_perm`).
        anchor: [B, H, D], the mean target-video query (`target_anchor`).
        kernels: the call's kernels (`kernels/registry.py`; default: the torch reference).
    Returns:
        (key [B,H,J,D] in k's dtype, value [B,H,J,D] in v's dtype, bias [B,H,J] in the accumulation
        dtype, -inf for a block without a finite key).
    """
    kernels = or_reference(kernels)
    return kernels.block_summaries(k, v, tiling.k_perm, tiling.block_len, tiling.block_size, anchor)


def block_reduce(q_mean: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                 dense_hi: torch.Tensor, q2k_idx: torch.Tensor, q2k_num: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`block` granularity: the summaries of each query block scored once at its mean query,
    over the candidate blocks the routing (dense_hi, q2k_idx, q2k_num) leaves unselected
    (`plan.summary_mask`), in chunks of query blocks.

    Returns (log-mass [B,H,J], normalised value [B,H,J,D]); a block without summaries gets -inf.
    """
    acc = q_mean.dtype
    B, H, J, D = q_mean.shape
    lse = q_mean.new_empty(B, H, J)
    out = q_mean.new_empty(B, H, J, value.shape[-1])
    for i0, i1 in row_chunks((0, J), B * H * J):
        logits = torch.matmul(q_mean[:, :, i0:i1], key.to(acc).transpose(-1, -2)) * (D ** -0.5) + bias.unsqueeze(2)
        logits = logits.masked_fill(~summary_mask(dense_hi, q2k_idx, q2k_num, slice(i0, i1)), float("-inf"))
        m = torch.logsumexp(logits, -1)
        w = torch.exp(logits - torch.where(torch.isfinite(m), m, torch.zeros_like(m)).unsqueeze(-1))
        lse[:, :, i0:i1], out[:, :, i0:i1] = m, torch.matmul(w, value.to(acc))
    return lse, out


def coarse_branch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan, granularity: str,
                  kernels: Kernels | None = None) -> torch.Tensor:
    """Coarse branch C of `tail="coarse"` in model order [B, H, S, D], zero on rows of dense query
    blocks; the caller adds it scaled by the model's gate (it is computed only when there is one).

    Args:
        q, k, v: the call's inputs [B, H, S, D], model order.
        plan: the call's plan (its tiling and dense prefix).
        granularity: `block`: C_i = softmax_j(E_ij) V-bar_j broadcast to the rows of query block i
            E the pooled scores, in chunks of query blocks; `query`: every row uses its
            own query against the pooled keys, softmax_j(q.k-bar_j / sqrt(D)), in chunks of rows.
        kernels: the call's kernels (`kernels/registry.py`; default: the torch reference).
    Returns:
        C in q's dtype.
    """
    B, H, S, D = q.shape
    tiling = plan.tiling
    J, bs = tiling.num_blocks, tiling.block_size
    k_mean = block_means(k, tiling.k_perm, tiling, kernels)
    v_mean = block_means(v, tiling.k_perm, tiling, kernels)
    sparse_blocks = plan.dense_hi < J
    if granularity == "block":
        q_mean = block_means(q, tiling.q_perm, tiling, kernels)
        per_block = v_mean.new_empty(B, H, J, D)
        for i0, i1 in row_chunks((0, J), B * H * J):
            scores = pooled_scores(q_mean, k_mean, (i0, i1), kernels)
            per_block[:, :, i0:i1] = torch.matmul(torch.softmax(scores, -1), v_mean)
        per_block = per_block * sparse_blocks.view(1, 1, J, 1)
        rows = per_block.repeat_interleave(bs, 2)
        return unpack(rows.to(q.dtype), tiling.q_perm, S)
    c = v_mean.new_empty(B, H, S, D)
    for s0, s1 in row_chunks((0, S), B * H * J, align=1):
        logits = torch.matmul(q[:, :, s0:s1].to(k_mean.dtype), k_mean.transpose(-1, -2)) * (D ** -0.5)
        c[:, :, s0:s1] = torch.matmul(torch.softmax(logits, -1), v_mean)
    flag = unpack(sparse_blocks.to(c.dtype).view(1, 1, J, 1).repeat_interleave(bs, 2).expand(B, H, -1, 1).contiguous(),
                  tiling.q_perm, S)
    return (c * flag).to(q.dtype)
