"""Block-sparse attention kernels and the pure-torch reference they are tested against.

`run_block_sparse` picks the implementation: the Triton kernel on CUDA (or under
TRITON_INTERPRET=1 when asked for explicitly), the reference otherwise. Importing this package
needs neither Triton nor a GPU.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from .plan import EMPTY_ROW_LSE, BlockSparsePlan, pack, unpack
from .reference import block_sparse_reference

__all__ = ["BlockSparsePlan", "EMPTY_ROW_LSE", "block_sparse_reference", "pack", "unpack",
           "run_block_sparse", "triton_unavailable_reason"]


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run on `device`, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the tensors are on {device.type}, and Triton runs on CUDA (or on CPU with TRITON_INTERPRET=1)"
    return None


def run_block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                     backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of block-sparse attention with the named backend ("torch" or "triton")."""
    if backend == "triton":
        from .custom_op import block_sparse_op

        return block_sparse_op(q, k, v, plan)
    return block_sparse_reference(q, k, v, plan)
