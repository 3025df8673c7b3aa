"""Block-sparse attention kernels, the pure-torch references they are tested against, and the one
table of operations x backends between them (`table.py`). Importing this package needs neither
Triton nor a GPU.
"""
from __future__ import annotations

from .plan import EMPTY_ROW_LSE, BlockSparsePlan, BlockSummaries, QuerySummaries, RoutingGroup, Tiling, pack, unpack
from .reference import block_sparse_reference
from .table import BACKENDS, Kernels, resolve, resolve_backend

__all__ = ["BACKENDS", "BlockSparsePlan", "BlockSummaries", "EMPTY_ROW_LSE", "Kernels", "QuerySummaries",
           "RoutingGroup", "Tiling", "block_sparse_reference", "pack", "resolve", "resolve_backend", "unpack"]
