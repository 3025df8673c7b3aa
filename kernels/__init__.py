"""Block-sparse attention kernels: at this level what every implementation shares (the plan, the
vocabulary an implementation declares itself in, the registry that resolves a call, the custom ops),
below it one package per implementation family (`reference`, `triton`, `cudnn`) and the measured
dense choice (`dense`). Importing this package needs neither Triton nor a GPU.
"""
from __future__ import annotations

from .plan import EMPTY_ROW_LSE, BlockSparsePlan, BlockSummaries, QuerySummaries, RoutingGroup, Tiling, pack, unpack
from .reference.reference import block_sparse_reference
from .registry import FAMILIES, Kernels, resolve, resolve_family

__all__ = ["BlockSparsePlan", "BlockSummaries", "EMPTY_ROW_LSE", "FAMILIES", "Kernels", "QuerySummaries",
           "RoutingGroup", "Tiling", "block_sparse_reference", "pack", "resolve", "resolve_family", "unpack"]
