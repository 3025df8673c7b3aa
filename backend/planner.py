"""Planner: tiling -> pooled scores -> per-region TopK -> index tables + tail summaries.

Everything runs on the device of Q/K/V with no host synchronisation; only the shape-only cube
tiling is built on the host, once per layout, and cached.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..kernels.plan import BlockSparsePlan
from .cache import BoundedCache
from .config import SparseConfig
from .layout import SequenceLayout
from .pooling import block_means
from .indexer import fp8_unavailable_reason
from .routing import route_blocks, route_plan
from .tail import block_reduce, coarse_output, mean_summaries, reweight_summaries, target_anchor
from .tiling import Tiling, cube_tiling

_CUBE_TILINGS: BoundedCache[Tiling] = BoundedCache(8)  # a few shapes per session
log = logging.getLogger("adaptive_sparse_attention")
_warned: set[str] = set()


@dataclass
class Plan:
    """A complete plan: the kernel's tensors, the tiling they came from and routing metadata."""

    kernel: BlockSparsePlan
    tiling: Tiling
    groups: list[tuple[int, int, int]]  # candidate key block ranges and their budgets
    coarse: torch.Tensor | None  # additive coarse term in model order (tail="coarse")


def cached_cube_tiling(layout: SequenceLayout, block_size: int, device: torch.device) -> Tiling:
    return _CUBE_TILINGS.get((layout.signature(), block_size, str(device)),
                             lambda: cube_tiling(layout, block_size, device))


def make_tiling(q: torch.Tensor, k: torch.Tensor, layout: SequenceLayout, config: SparseConfig) -> Tiling:
    if config.tiling == "cube":
        return cached_cube_tiling(layout, config.block_size, q.device)
    from .reblock import reblock_tiling

    return reblock_tiling(q, k, layout, config.block_size, config.reblock_layout, config.topk_ratio)


def build_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
               config: SparseConfig, tiling: Tiling | None = None) -> Plan:
    """Plan sparse attention of q, k, v [B, H, S, D] (model order) under `config`."""
    tiling = make_tiling(q, k, layout, config) if tiling is None else tiling
    q_mean = block_means(q, tiling.q_perm, tiling)
    k_mean = block_means(k, tiling.k_perm, tiling)
    dense_hi, groups = route_plan(tiling, config.sparse_scope, config.topk_ratio)
    q2k_idx, q2k_num = route_blocks(q_mean, k_mean, dense_hi, groups, routing_scores(config, q.device))
    kernel = BlockSparsePlan(tiling.block_size, tiling.q_perm, tiling.k_perm, tiling.block_len,
                             dense_hi, q2k_idx, q2k_num)
    coarse = None
    if config.tail in ("mean", "reweight"):
        if config.tail == "mean":
            key, value, bias = mean_summaries(k, v, tiling, k_mean)
        else:
            key, value, bias = reweight_summaries(k, v, tiling, target_anchor(q_mean, tiling))
        if config.tail_granularity == "query":
            kernel.tail_k, kernel.tail_v, kernel.tail_bias = key, value, bias
        else:
            kernel.block_logit, kernel.block_value = block_reduce(q_mean, key, value, bias, kernel)
    elif config.tail == "coarse":
        v_mean = block_means(v, tiling.k_perm, tiling)
        coarse = coarse_output(q, tiling, q_mean, k_mean, v_mean, dense_hi < tiling.num_blocks,
                               config.tail_granularity)
    return Plan(kernel, tiling, groups, coarse)


def routing_scores(config: SparseConfig, device: torch.device) -> str:
    """The routing score format to use: `config.routing_scores`, except fp8 on a GPU without it,
    which raises (strict) or runs int8 and says so once."""
    reason = fp8_unavailable_reason(device) if config.routing_scores == "fp8" else None
    if reason is None:
        return config.routing_scores
    if config.strict:
        raise RuntimeError(f"SparseConfig.routing_scores='fp8' cannot run: {reason} (strict mode)")
    if reason not in _warned:
        _warned.add(reason)
        log.warning("%s; routing with int8 scores instead", reason)
    return "int8"
