"""The `torch` family's rows: the pure-torch reference of every operation (any device, any dtype)."""
from __future__ import annotations

from typing import Callable

from ..vocabulary import Family, Implementation
from . import planner_reference as ref
from .norm_rope import norm_rope_torch
from . import reblock_reference as tree_ref
from .reference import ReferenceAttention, block_sparse_reference


def _torch(operation: str, function: Callable) -> Implementation:
    return Implementation(operation, "torch", lambda: function)


TORCH = Family("torch", (
    _torch("norm_rope", norm_rope_torch),
    _torch("block_sums", ref.block_sums_torch),
    _torch("block_summaries", ref.block_summaries_torch),
    _torch("pooled_scores", ref.pooled_scores_torch),
    _torch("quantised_scores", ref.quantised_scores_torch),
    _torch("select_blocks", ref.select_blocks_torch),
    _torch("block_log_mass", ref.block_log_mass_torch),
    _torch("top_share", ref.top_share_torch),
    _torch("metric_gram", tree_ref.gram_torch),
    _torch("metric_project", tree_ref.metric_project_torch),
    _torch("partition_level", tree_ref.partition_level_torch),
    _torch("attention", ReferenceAttention()),
), auto="any", compiles=False, helpers=(
    _torch("oracle", block_sparse_reference),  # on chosen query blocks: the sparse choice's check (`registry.helper`)
))
