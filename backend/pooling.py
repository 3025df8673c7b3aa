"""Block pooling: rows gathered per block by a tiling's permutation, and their means.

Heads are processed a few at a time so the gathered copy stays a small fraction of Q/K/V.
"""
from __future__ import annotations

import torch

from ..kernels.dispatch import runs_triton
from ..kernels.plan import pack, perm_heads
from .tiling import Tiling

POOL_HEADS = 8
CHUNK_ELEMENTS = 1 << 26  # per-block planner buffers that grow with J x J are streamed in row
# chunks of at most this many elements (256 MB of fp32), so planner memory stays linear in J


def row_chunks(rows: tuple[int, int], per_row: int, align: int = 64) -> list[tuple[int, int]]:
    """[lo, hi) split into chunks of whole `align`-row tiles (counted from 0, so chunks start at
    multiples of `align` except possibly the first) holding at most CHUNK_ELEMENTS elements of
    `per_row` each (at least one tile per chunk). A range that fits in twice that is one chunk:
    a second pass would cost more time than its memory saves (10 s clips), while long clips,
    where the bound matters, still stream."""
    lo, hi = rows
    if (hi - lo) * per_row <= 2 * CHUNK_ELEMENTS:
        return [(lo, hi)] if hi > lo else []
    step = max(align, CHUNK_ELEMENTS // max(1, per_row) // align * align)
    starts = [lo] + list(range((lo // step + 1) * step, hi, step))
    return [(a, min(hi, b)) for a, b in zip(starts, starts[1:] + [hi]) if a < min(hi, b)]


def accum_dtype(x: torch.Tensor) -> torch.dtype:
    """Dtype the planner reduces x in: float64 for float64 inputs (the reference), else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def block_rows(x: torch.Tensor, perm: torch.Tensor, tiling: Tiling, h0: int, h1: int) -> torch.Tensor:
    """Heads h0:h1 of x gathered into blocks: [B, h, J, block_size, D] in the accumulation dtype."""
    rows = pack(x[:, h0:h1], perm_heads(perm, h0, h1)).to(accum_dtype(x))
    return rows.view(x.shape[0], h1 - h0, tiling.num_blocks, tiling.block_size, x.shape[-1])


def block_means(x: torch.Tensor, perm: torch.Tensor, tiling: Tiling, backend: str = "torch") -> torch.Tensor:
    """Per-block means over valid rows [B, H, J, D]; pooling divides by each block's true length.

    Rows are summed in the accumulation dtype without materialising an upcast copy. Non-finite
    entries of a mean (a NaN or inf row in the block) become 0, on the device: everything pooled
    from the means (scores, TopK, anchors, block summaries) stays finite, so one bad row cannot
    spread beyond the rows that read it directly. Finite means are unchanged."""
    B, H, _, D = x.shape
    acc = accum_dtype(x)
    n = tiling.block_len.to(acc).view(1, 1, -1, 1)
    if runs_triton(backend):  # kernels/block_stats.py
        from ..kernels.block_stats import block_sums_triton

        out = block_sums_triton(x, perm, tiling.block_len, tiling.block_size) / n
    else:
        out = x.new_empty(B, H, tiling.num_blocks, D, dtype=acc)
        for h0 in range(0, H, POOL_HEADS):
            h1 = min(H, h0 + POOL_HEADS)
            rows = pack(x[:, h0:h1], perm_heads(perm, h0, h1))
            out[:, h0:h1] = rows.view(B, h1 - h0, tiling.num_blocks, tiling.block_size, D).sum(3, dtype=acc) / n
    return out.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


