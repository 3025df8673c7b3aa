"""The capacity-exact tree partition of a region's features, level by level.

The features stay in token order; what moves from level to level are the int32 token ids of
every node's slots. Each level is one call of the table's `partition_level` (Triton: split
directions from landmarks, radix-select split and placement, `kernels/triton/reblock_split.py`; torch:
selection and prefix sums, `kernels/reference/reblock_reference.py`). No sort anywhere; work is
O(N log N) per head.
"""
from __future__ import annotations

import torch

from ..kernels.registry import Kernels, or_reference
from .reblock_schedule import Schedule


def partition(z: torch.Tensor, schedule: Schedule, kernels: Kernels | None = None) -> torch.Tensor:
    """Capacity-exact tree partition of features z [G, N, r]: block slots -> row [G, blocks * bs], -1 pads.

    The features stay in token order; what moves from level to level are the int32 token ids of
    every node's slots (`kernels.partition_level`, one call per level)."""
    kernels = or_reference(kernels)
    G, N, _ = z.shape
    rows = torch.arange(N, device=z.device, dtype=torch.int32).expand(G, 1, N)  # the root is every token
    for level in schedule.levels:
        rows = kernels.partition_level(z, rows, level)
    rows = torch.nn.functional.pad(rows.reshape(G, -1), (0, 1), value=-1)
    return torch.index_select(rows, 1, schedule.leaf_slots).long()
