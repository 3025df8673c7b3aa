"""Planner: tiling -> pooled scores -> per-region TopK -> the plan (index tables + tail summaries).

Everything runs on the device of Q/K/V with no host synchronisation; only the shape-only cube
tiling is built on the host, once per layout, and kept by the layout. The kernels it runs are the
call's resolution of the table (`kernels/registry.py`).
"""
from __future__ import annotations

import torch

from ..errors import SparseAttentionError
from ..kernels.plan import BlockSparsePlan, BlockSummaries, QuerySummaries, Tail, Tiling, group_span
from ..kernels.registry import Kernels, resolve
from ..notices import Notices
from .config import SparseConfig
from .indexer import fp8_unavailable_reason
from .layout import SequenceLayout
from .plan_reuse import PlanSlot, plan_facts
from .pooling import block_means
from .routing import route_blocks, route_plan
from .tail import block_reduce, mean_summaries, reweight_summaries, target_anchor
from .tiling import cube_tiling


def call_kernels(q: torch.Tensor, layout: SequenceLayout, config: SparseConfig) -> Kernels:
    """The kernels of a call on q under `config` (`layout_kernels`)."""
    return layout_kernels(layout, config, q.device, q.dtype, q.shape[-1])


def layout_kernels(layout: SequenceLayout, config: SparseConfig, device: torch.device, dtype: torch.dtype,
                   head_dim: int) -> Kernels:
    """The kernels of calls on `layout` under `config` (`kernels.registry.resolve`), resolved once per
    (request, device, dtype, head dim, block size) and kept by the layout, which also owns the
    once-only record of the fallbacks it says."""
    key = (config.kernel, config.strict, str(device), dtype, head_dim, config.block_size, config.exact_precision)
    return layout.cache.get("kernels", key, lambda: resolve(
        config.kernel, device, dtype, strict=config.strict, head_dim=head_dim, block_size=config.block_size,
        notices=layout.cache.notices, precision=config.exact_precision))


def cached_cube_tiling(layout: SequenceLayout, block_size: int, device: torch.device) -> Tiling:
    """`cube_tiling` of the layout, built once per (block size, device) and kept by the layout."""
    return layout.cache.get("cube_tiling", (block_size, str(device)), lambda: cube_tiling(layout, block_size, device))


def make_tiling(q: torch.Tensor, k: torch.Tensor, layout: SequenceLayout, config: SparseConfig,
                kernels: Kernels | None = None) -> Tiling:
    """The tiling `config.tiling` asks for: the cached cube tiling, or a reblock tiling of q, k."""
    if config.tiling == "cube":
        return cached_cube_tiling(layout, config.block_size, q.device)
    from .reblock import reblock_tiling

    return reblock_tiling(q, k, layout, config.block_size, config.reblock_layout, config.topk_ratio, kernels=kernels)


def build_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
               config: SparseConfig, tiling: Tiling | None = None, kernels: Kernels | None = None,
               slot: PlanSlot | None = None) -> BlockSparsePlan:
    """Plan sparse attention of q, k, v [B, H, S, D] (model order) under `config`.

    Args:
        q, k, v: the call's inputs, model order.
        layout: their segments.
        config: the engine's settings.
        tiling: a tiling to use instead of the one `config.tiling` builds.
        kernels: the kernels to plan with (`kernels.registry.resolve`); default: `call_kernels`.
        slot: the plan kept from this block's last evaluated step (`plan_reuse.PlanSlot`): its tiling
            and routing are reused when its rule allows, and a fresh plan is kept there otherwise.
            Not with `tiling`.
    Returns:
        The plan. With ``tail="coarse"`` it has no tail: the coarse branch is an additive term
        (`tail.coarse_branch`).
    """
    if slot is not None and tiling is not None:
        raise SparseAttentionError("build_plan: give a tiling or a plan slot to reuse, not both")
    kernels = call_kernels(q, layout, config) if kernels is None else kernels
    facts = None if slot is None else plan_facts(q, config, (layout.signature(), kernels.family))
    kept = None if slot is None else slot.reusable(facts)
    tiling = (make_tiling(q, k, layout, config, kernels) if kept is None else kept.tiling) if tiling is None else tiling
    q_mean = block_means(q, tiling.q_perm, tiling, kernels)
    k_mean = block_means(k, tiling.k_perm, tiling, kernels)
    dense_hi, groups = route_plan(tiling, config.sparse_scope, config.topk_ratio, layout.cache)
    if kept is None:
        q2k_idx, q2k_num = route_blocks(q_mean, k_mean, dense_hi, groups,
                                        routing_scores(config, q.device, layout.cache.notices), kernels,
                                        group_span(groups))
        if slot is not None:
            slot.keep(facts, tiling, q2k_idx, q2k_num, q_mean, k_mean)
    else:
        q2k_idx, q2k_num = kept.q2k_idx, kept.q2k_num
        slot.check(q_mean, k_mean, group_span(groups))
    tail: Tail = None
    if config.tail in ("mean", "reweight"):
        if config.tail == "mean":
            key, value, bias = mean_summaries(k, v, tiling, kernels)
        else:
            key, value, bias = reweight_summaries(k, v, tiling, target_anchor(q_mean, tiling), kernels)
        tail = QuerySummaries(key, value, bias)
        if config.tail_granularity == "block":
            tail = BlockSummaries(*block_reduce(q_mean, key, value, bias, dense_hi, q2k_idx, q2k_num))
    return BlockSparsePlan(tiling, dense_hi, q2k_idx, q2k_num, groups, tail)


def routing_scores(config: SparseConfig, device: torch.device, notices: Notices) -> str:
    """The routing score format to use: `config.routing_scores`, except fp8 on a GPU without it,
    which raises (strict) or runs int8 and says so once into `notices` (the owner's record)."""
    reason = fp8_unavailable_reason(device) if config.routing_scores == "fp8" else None
    if reason is None:
        return config.routing_scores
    notices.fallback(f"SparseConfig.routing_scores='fp8' cannot run: {reason}", "routing with int8 scores instead",
                     config.strict)
    return "int8"
