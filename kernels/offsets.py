"""Offsets of the kernels' gathered rows: whether they fit 32-bit indexing, and a permutation's strides."""
from __future__ import annotations

import torch

ROW_INDEX_LIMIT = 2 ** 31


def wide_rows(*tensors: torch.Tensor) -> bool:
    """Whether the rows of one (batch, head) of any [B, H, S, D] tensor span 2^31 elements or more.

    Contiguous inputs do not; H3's q/k as strided views of the fused qkv buffer (3*H*D elements
    per row) do from about 100k tokens.

    Args:
        tensors: [B, H, S, D] tensors (any strides, any device, meta included).
    Returns:
        True if some row * row stride + dim * dim stride can reach 2^31.
    """
    return any((t.shape[2] - 1) * abs(t.stride(2)) + (t.shape[3] - 1) * abs(t.stride(3)) >= ROW_INDEX_LIMIT
               for t in tensors if t.shape[2] > 0 and t.shape[3] > 0)


def perm_strides(perm: torch.Tensor) -> tuple[int, int]:
    """(batch, head) strides of a [Bp, Hp, L] permutation; 0 where it is shared."""
    return (perm.stride(0) if perm.shape[0] > 1 else 0, perm.stride(1) if perm.shape[1] > 1 else 0)
