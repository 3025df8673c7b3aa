"""The cases the kernel check measures: the H3 shapes, the plan it times, the pairs a plan computes."""
from __future__ import annotations

import torch

from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.backend.layout import SequenceLayout
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.bench.scenes import SIZES
from adaptive_sparse_attention.kernels.plan import BlockSparsePlan, BlockSummaries, QuerySummaries, perm_heads

H3_SHAPES = {name: SIZES[f"h3-{name}"] for name in ("5s", "10s", "14s")}  # the bench presets' shapes
HEADS, DIM = H3_SHAPES["10s"].heads, H3_SHAPES["10s"].head_dim


def plan_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, ratio: float,
             gran: str = "query", block_size: int = 64) -> tuple[BlockSparsePlan, SparseConfig]:
    """The plan the kernel is timed on: cube tiling (its layout costs nothing to build), reweight tails.

    Args:
        q, k, v: [B, H, S, D] inputs.
        layout: their sequence layout.
        ratio: the top-k ratio.
        gran: the tail granularity, query or block.
        block_size: tokens per block.
    Returns:
        (the plan, the config it was built with).
    """
    cfg = SparseConfig(tiling="cube", topk_ratio=ratio, tail="reweight", tail_granularity=gran, block_size=block_size)
    return build_plan(q, k, v, layout, cfg), cfg


def computed_pairs(plan: BlockSparsePlan) -> tuple[float, float]:
    """(exact query-key pairs, summary pairs) the kernel computes, summed over batch and heads: the
    work a throughput figure counts."""
    blen = plan.block_len.long()
    prefix = torch.cat([blen.new_zeros(1), blen.cumsum(0)])
    J, R = plan.num_blocks, plan.q2k_idx.shape[-1]
    valid = torch.arange(R, device=blen.device) < plan.q2k_num.unsqueeze(-1)
    picked = torch.where(valid, blen[plan.q2k_idx.long().clamp(min=0)], 0).sum(-1)
    exact = ((prefix[plan.dense_hi.long()] + picked) * blen).sum()
    summary = 0.0
    if isinstance(plan.tail, QuerySummaries):
        summary = float((((J - plan.dense_hi.long()) - plan.q2k_num.long()) * blen).sum())
    elif isinstance(plan.tail, BlockSummaries):
        summary = float(blen.sum()) * plan.q2k_num.shape[0] * plan.q2k_num.shape[1]
    return float(exact), summary


def pack_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan, pack, heads_per_call: int
                ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Q/K/V packed into tiled order `heads_per_call` heads at a time by `pack` (the Triton family's `tiled_pack`),
    as `packed.exact_in_chunks` packs them before its kernel: the pack alone, to time it apart."""
    H = q.shape[1]
    return [pack(q[:, a:b], k[:, a:b], v[:, a:b], perm_heads(plan.q_perm, a, b), perm_heads(plan.k_perm, a, b))
            for a, b in ((h0, min(H, h0 + heads_per_call)) for h0 in range(0, H, heads_per_call))]
