"""Block pooling: the means of the rows every block of a tiling gathers, and the planner's row chunks."""
from __future__ import annotations

import torch

from ..kernels.reference.planner_reference import accum_dtype
from ..kernels.registry import Kernels, or_reference
from .tiling import Tiling

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


def block_means(x: torch.Tensor, perm: torch.Tensor, tiling: Tiling, kernels: Kernels | None = None) -> torch.Tensor:
    """Per-block means over valid rows [B, H, J, D]; pooling divides by each block's true length.

    Rows are summed in the accumulation dtype (`kernels.block_sums`) without materialising an
    upcast copy. Non-finite entries of a mean (a NaN or inf row in the block) become 0, on the
    device: everything pooled from the means (scores, TopK, anchors, block summaries) stays
    finite, so one bad row cannot spread beyond the rows that read it directly."""
    kernels = or_reference(kernels)
    n = tiling.block_len.to(accum_dtype(x)).view(1, 1, -1, 1)
    out = kernels.block_sums(x, perm, tiling.block_len, tiling.block_size) / n
    return out.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
