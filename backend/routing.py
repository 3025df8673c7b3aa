"""Routing: block means of Q and K, pooled scores, per-region TopK, index tables.

Every query block of a sparse region keeps, per candidate key region r, the R_r key blocks with
the highest pooled score E = q_mean k_mean^T / sqrt(D) (fp32), where
R_r = max(1, min(J_r, ceil(ratio * J_r))). Ties break toward the lower block index, so the
selection is deterministic and has exactly R_r entries. Context keys are never candidates: they
are always computed exactly (the dense prefix [0, dense_hi) of every query block).

`route_blocks` never holds the [B, H, J, J] scores: it streams them in chunks of query blocks
(whole 64-block tiles, at most `pooling.CHUNK_ELEMENTS` scores per chunk, over the candidate
columns only) and keeps each chunk's exact per-group TopK, so its memory is O(H x J x R) plus
one chunk. The chunk's scores are the full matrix's (the same tiles of the same kernel, or the
same matmul rows), so the selection is bit for bit that of `select_blocks(pooled_scores(...))`.
With `scores="int8"` or `"fp8"` the chunks come from 8-bit block means (`backend/indexer.py`).
"""
from __future__ import annotations

import math

import torch

from ..errors import SparseAttentionError
from ..kernels.plan import RoutingGroup
from ..kernels.registry import Kernels, or_reference
from .cache import ShapeCache
from .config import ROUTING_SCORES
from .indexer import QuantisedMeans, quantise_means
from .layout import CONTEXT, TARGET_VIDEO
from .pooling import row_chunks
from .tiling import Tiling

TILE = 64  # score windows start at multiples of the score kernel's tile (kernels/triton/block_scores.py)


def region_budget(num_blocks: int, ratio: float) -> int:
    """R = max(1, min(J, ceil(ratio * J))); the product is rounded to 9 decimals first so that
    e.g. 0.1 * 30 counts as 3, not 4."""
    return max(1, min(num_blocks, math.ceil(round(ratio * num_blocks, 9))))


def pooled_scores(q_mean: torch.Tensor, k_mean: torch.Tensor, rows: tuple[int, int] | None = None,
                  kernels: Kernels | None = None) -> torch.Tensor:
    """E = q_mean k_mean^T / sqrt(D), fp32 [B, H, J, J] (fp64 for fp64 means), or its rows
    (i0, i1) (i0 a multiple of 64) [B, H, i1 - i0, J] (`kernels.pooled_scores`: on Triton a
    kernel on tensor cores at about fp32 accuracy)."""
    J = q_mean.shape[2]
    rows = (0, J) if rows is None else rows
    return _score_window(q_mean, k_mean, rows, (0, J), or_reference(kernels))


def index_table(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean block mask [..., J] -> (q2k_idx [..., J] int32, ascending, -1 padded; q2k_num [...] int32).

    The row width is the candidate count; kernels read only
    the first q2k_num entries.
    """
    J = mask.shape[-1]
    cols = torch.arange(J, device=mask.device, dtype=torch.int32).expand_as(mask)
    keyed = torch.where(mask, cols, torch.full_like(cols, J))
    idx = torch.sort(keyed, dim=-1).values
    idx = torch.where(idx == J, torch.full_like(idx, -1), idx)
    return idx, mask.sum(-1, dtype=torch.int32)


def route_plan(tiling: Tiling, scope: str, ratio: float, cache: ShapeCache | None = None
               ) -> tuple[torch.Tensor, tuple[RoutingGroup, ...]]:
    """Shape-only part of routing: dense_hi [J] int32 per query block, and the candidate groups
    (lo, hi, budget) that sparse query blocks route over; the sparse query blocks are exactly the
    span [first lo, last hi) of the groups, every other block is dense. Kept in `cache` (the
    layout's) per (block ranges, scope, ratio, device): built on the host once, so planning a block
    copies nothing from the host (a copy from pageable host memory waits for the GPU to drain, which
    would stop the host running ahead). Without a cache it is built every call."""
    if cache is None:
        return _route_plan(tiling, scope, ratio)
    key = (tiling.region_blocks, tiling.block_size, scope, ratio, str(tiling.block_len.device))
    return cache.get("route_plan", key, lambda: _route_plan(tiling, scope, ratio))


def _route_plan(tiling: Tiling, scope: str, ratio: float) -> tuple[torch.Tensor, tuple[RoutingGroup, ...]]:
    J = tiling.num_blocks
    t_lo, t_hi = tiling.blocks_of(TARGET_VIDEO)
    dense_hi = torch.full((J,), J, dtype=torch.int32)
    if scope == "target-video":
        groups = [(t_lo, t_hi)]
        dense_hi[t_lo:t_hi] = t_lo
    else:  # joint-video: every video region is sparse; each key region is its own TopK group
        groups = [rb for seg, rb in zip(tiling.regions, tiling.region_blocks) if seg.region != CONTEXT]
        v_lo = tiling.blocks_of(CONTEXT)[1]  # context blocks come first
        dense_hi[v_lo:] = v_lo
    return dense_hi.to(tiling.block_len.device), tuple(RoutingGroup(lo, hi, region_budget(hi - lo, ratio)) for lo, hi in groups)


def select_blocks(scores: torch.Tensor, dense_hi: torch.Tensor, groups: tuple[RoutingGroup, ...],
                  kernels: Kernels | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group TopK for every sparse query block: (q2k_idx [B, H, J, R] int32 ascending with -1
    rows for dense query blocks, q2k_num [B, H, J] int32). R = sum of the group budgets."""
    kernels = or_reference(kernels)
    idx = kernels.select_blocks(scores, dense_hi, groups)
    return idx.contiguous(), _counts(idx, dense_hi)


def _counts(idx: torch.Tensor, dense_hi: torch.Tensor) -> torch.Tensor:
    B, H, J, R = idx.shape
    return ((dense_hi < J).to(torch.int32) * R).view(1, 1, J).expand(B, H, J).contiguous()


def route_blocks(q_mean: torch.Tensor, k_mean: torch.Tensor, dense_hi: torch.Tensor,
                 groups: tuple[RoutingGroup, ...], scores: str = "fp32", kernels: Kernels | None = None,
                 sparse_rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_blocks(pooled_scores(q_mean, k_mean), dense_hi, groups)` without the [B, H, J, J]
    scores: streamed in chunks of query blocks (see the module docstring).

    Args:
        q_mean, k_mean: block means [B, H, J, D] (fp32; fp64 on the torch path).
        dense_hi: int32 [J]; query blocks with dense_hi == J are dense (their rows are -1).
        groups: candidate key block ranges (lo, hi, budget), ascending and disjoint.
        scores: "fp32" (the exact pooled scores) or "int8" / "fp8" (`backend/indexer.py`).
        kernels: the call's kernels (`kernels/registry.py`; default: the torch reference).
        sparse_rows: [lo, hi) query blocks that may be sparse, when the caller knows that every
            block outside is dense (for `route_plan`'s groups: `plan.group_span(groups)`); only
            these rows are scored. None: every row is scored.
    Returns:
        (q2k_idx [B, H, J, R] ascending, int16 while J < 2**15 else int32; q2k_num [B, H, J]
        int32), R = sum of the budgets.
    """
    if scores not in ROUTING_SCORES:
        raise SparseAttentionError(f"route_blocks: scores={scores!r} is not allowed: expected one of "
                         + ", ".join(repr(s) for s in ROUTING_SCORES))
    B, H, J, _ = q_mean.shape
    R = sum(budget for _, _, budget in groups)
    c0 = min(lo for lo, _, _ in groups) // TILE * TILE  # candidate columns [c0, c1), tile-aligned
    c1 = max(hi for _, hi, _ in groups)
    kernels = or_reference(kernels)
    means = q_mean if scores == "fp32" else quantise_means(q_mean, k_mean, scores)
    lo, hi = (0, J) if sparse_rows is None else sparse_rows
    if not (0 <= lo <= hi <= J):
        raise SparseAttentionError(f"route_blocks: sparse_rows={sparse_rows!r} is not allowed: expected 0 <= lo <= hi <= {J}")
    lo = lo // TILE * TILE  # windows start on a score tile, as in the full matrix (bit-identical scores)
    idx = torch.empty(B, H, J, R, dtype=torch.int16 if J < 2 ** 15 else torch.int32, device=q_mean.device)
    if (lo, hi) != (0, J):
        idx.fill_(-1)  # rows never scored are dense ones
    for i0, i1 in row_chunks((lo, hi), B * H * (c1 - c0)):  # dense rows inside get -1 from the selection
        kernels.select_blocks(_score_window(means, k_mean, (i0, i1), (c0, c1), kernels), dense_hi, groups, idx, i0, c0)
    return idx, _counts(idx, dense_hi)


def _score_window(means: torch.Tensor | QuantisedMeans, k_mean: torch.Tensor, rows: tuple[int, int],
                  cols: tuple[int, int], kernels: Kernels) -> torch.Tensor:
    """Rows x cols of the routing scores, fp32 (fp64 for fp64 means on the torch path)."""
    if isinstance(means, QuantisedMeans):
        return kernels.quantised_scores(means.q_codes, means.q_scale, means.k_codes, means.k_scale, rows, cols)
    return kernels.pooled_scores(means, k_mean, rows, cols)
