"""Block-sparse attention kernels, the pure-torch reference they are tested against, and the one
dispatch between them (`dispatch.py`). Importing this package needs neither Triton nor a GPU.
"""
from __future__ import annotations

from .dispatch import BACKENDS, block_sparse_attention, resolve_backend, triton_unavailable_reason
from .plan import EMPTY_ROW_LSE, BlockSparsePlan, BlockSummaries, QuerySummaries, Tiling, pack, unpack
from .reference import block_sparse_reference

__all__ = ["BACKENDS", "BlockSparsePlan", "BlockSummaries", "EMPTY_ROW_LSE", "QuerySummaries", "Tiling",
           "block_sparse_attention", "block_sparse_reference", "pack", "resolve_backend", "triton_unavailable_reason",
           "unpack"]
