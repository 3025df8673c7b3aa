"""Routing (seed 000): block means of Q and K, pooled scores, per-region TopK, index tables.

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

from ..kernels.dispatch import runs_triton
from .cache import BoundedCache
from .config import ROUTING_SCORES
from .indexer import QuantisedMeans, quantise_means, quantised_scores
from .layout import CONTEXT, TARGET_VIDEO
from .pooling import row_chunks
from .tiling import Tiling

_ROUTES: BoundedCache[tuple[torch.Tensor, tuple[tuple[int, int, int], ...]]] = BoundedCache(16)
TILE = 64  # score windows start at multiples of the score kernel's tile (kernels/block_scores.py)


def region_budget(num_blocks: int, ratio: float) -> int:
    """R = max(1, min(J, ceil(ratio * J))); the product is rounded to 9 decimals first so that
    e.g. 0.1 * 30 counts as 3, not 4."""
    return max(1, min(num_blocks, math.ceil(round(ratio * num_blocks, 9))))


def pooled_scores(q_mean: torch.Tensor, k_mean: torch.Tensor, rows: tuple[int, int] | None = None,
                  backend: str = "torch") -> torch.Tensor:
    """E = q_mean k_mean^T / sqrt(D), fp32 [B, H, J, J] (fp64 for fp64 means), or its rows
    (i0, i1) (i0 a multiple of 64) [B, H, i1 - i0, J]. fp32 means on the Triton backend take a
    kernel on tensor cores at about fp32 accuracy (kernels/block_scores.py)."""
    J = q_mean.shape[2]
    rows = (0, J) if rows is None else rows
    return _score_window(q_mean, k_mean, rows, (0, J), runs_triton(backend) and q_mean.dtype == torch.float32)


def topk_blocks(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices of the `budget` largest scores along the last dim; ties -> lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :budget]


def index_table(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean block mask [..., J] -> (q2k_idx [..., J] int32, ascending, -1 padded; q2k_num [...] int32).

    Matches seed 000's map_to_index: the row width is the candidate count, kernels read only
    the first q2k_num entries.
    """
    J = mask.shape[-1]
    cols = torch.arange(J, device=mask.device, dtype=torch.int32).expand_as(mask)
    keyed = torch.where(mask, cols, torch.full_like(cols, J))
    idx = torch.sort(keyed, dim=-1).values
    idx = torch.where(idx == J, torch.full_like(idx, -1), idx)
    return idx, mask.sum(-1, dtype=torch.int32)


def route_plan(tiling: Tiling, scope: str, ratio: float) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Shape-only part of routing: dense_hi [J] int32 per query block, and the candidate groups
    (lo, hi, budget) that sparse query blocks route over; the sparse query blocks are exactly the
    span [first lo, last hi) of the groups, every other block is dense. Cached per (tiling shape, scope, ratio,
    device): built on the host once, so planning a block copies nothing from the host (a copy
    from pageable host memory waits for the GPU to drain, which would stop the host running ahead)."""
    key = (tiling.regions, tiling.region_blocks, scope, ratio, str(tiling.block_len.device))
    dense_hi, groups = _ROUTES.get(key, lambda: _route_plan(tiling, scope, ratio))
    return dense_hi, list(groups)


def _route_plan(tiling: Tiling, scope: str, ratio: float) -> tuple[torch.Tensor, tuple[tuple[int, int, int], ...]]:
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
    return dense_hi.to(tiling.block_len.device), tuple((lo, hi, region_budget(hi - lo, ratio)) for lo, hi in groups)


def select_blocks(scores: torch.Tensor, dense_hi: torch.Tensor, groups: list[tuple[int, int, int]],
                  backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group TopK for every sparse query block: (q2k_idx [B, H, J, R] int32 ascending with -1
    rows for dense query blocks, q2k_num [B, H, J] int32). R = sum of the group budgets."""
    B, H, J, _ = scores.shape
    if runs_triton(backend):  # radix-select TopK in one Triton kernel (kernels/block_select.py)
        from ..kernels.block_select import select_blocks_triton

        idx = select_blocks_triton(scores, dense_hi, groups)
    else:
        idx = _select_torch(scores, dense_hi < J, groups, 0)
    return idx.contiguous(), _counts(idx, dense_hi)


def _select_torch(scores: torch.Tensor, sparse: torch.Tensor, groups: list[tuple[int, int, int]], c0: int
                  ) -> torch.Tensor:
    """The stable-sort TopK of a score window (columns from key block c0; `sparse` [rows] marks
    its sparse query blocks): int32 [B, H, rows, R]."""
    picks = [topk_blocks(scores[..., lo - c0:hi - c0], budget) + lo for lo, hi, budget in groups]
    idx = torch.sort(torch.cat(picks, dim=-1), dim=-1).values.to(torch.int32)
    return torch.where(sparse.view(1, 1, -1, 1), idx, torch.full_like(idx, -1))


def _counts(idx: torch.Tensor, dense_hi: torch.Tensor) -> torch.Tensor:
    B, H, J, R = idx.shape
    return ((dense_hi < J).to(torch.int32) * R).view(1, 1, J).expand(B, H, J).contiguous()


def route_blocks(q_mean: torch.Tensor, k_mean: torch.Tensor, dense_hi: torch.Tensor,
                 groups: list[tuple[int, int, int]], scores: str = "fp32", backend: str = "torch",
                 sparse_rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_blocks(pooled_scores(q_mean, k_mean), dense_hi, groups)` without the [B, H, J, J]
    scores: streamed in chunks of query blocks (see the module docstring).

    Args:
        q_mean, k_mean: block means [B, H, J, D] (fp32; fp64 on the torch path).
        dense_hi: int32 [J]; query blocks with dense_hi == J are dense (their rows are -1).
        groups: candidate key block ranges (lo, hi, budget), ascending and disjoint.
        scores: "fp32" (the exact pooled scores) or "int8" / "fp8" (`backend/indexer.py`).
        backend: the kernels to run (`kernels/dispatch.py`).
        sparse_rows: [lo, hi) query blocks that may be sparse, when the caller knows that every
            block outside is dense (for `route_plan`'s groups: `plan.group_span(groups)`); only
            these rows are scored. None: every row is scored.
    Returns:
        (q2k_idx [B, H, J, R] ascending, int16 while J < 2**15 else int32; q2k_num [B, H, J]
        int32), R = sum of the budgets.
    """
    if scores not in ROUTING_SCORES:
        raise ValueError(f"route_blocks: scores={scores!r} is not allowed: expected one of "
                         + ", ".join(repr(s) for s in ROUTING_SCORES))
    B, H, J, _ = q_mean.shape
    R = sum(budget for _, _, budget in groups)
    c0 = min(lo for lo, _, _ in groups) // TILE * TILE  # candidate columns [c0, c1), tile-aligned
    c1 = max(hi for _, hi, _ in groups)
    fused = runs_triton(backend) and q_mean.dtype == torch.float32
    means = q_mean if scores == "fp32" else quantise_means(q_mean, k_mean, scores)
    lo, hi = (0, J) if sparse_rows is None else sparse_rows
    if not (0 <= lo <= hi <= J):
        raise ValueError(f"route_blocks: sparse_rows={sparse_rows!r} is not allowed: expected 0 <= lo <= hi <= {J}")
    lo = lo // TILE * TILE  # windows start on a score tile, as in the full matrix (bit-identical scores)
    idx = torch.empty(B, H, J, R, dtype=torch.int16 if J < 2 ** 15 else torch.int32, device=q_mean.device)
    if (lo, hi) != (0, J):
        idx.fill_(-1)  # rows never scored are dense ones
    for i0, i1 in row_chunks((lo, hi), B * H * (c1 - c0)):  # dense rows inside get -1 from the selection
        window = _score_window(means, k_mean, (i0, i1), (c0, c1), fused)
        if fused:
            from ..kernels.block_select import select_blocks_triton

            select_blocks_triton(window, dense_hi, groups, idx, i0, c0)
        else:
            idx[:, :, i0:i1] = _select_torch(window, dense_hi[i0:i1] < J, groups, c0)
    return idx, _counts(idx, dense_hi)


def _score_window(means: torch.Tensor | QuantisedMeans, k_mean: torch.Tensor, rows: tuple[int, int],
                  cols: tuple[int, int], fused: bool) -> torch.Tensor:
    """Rows x cols of the routing scores, fp32 (fp64 for fp64 means on the torch path)."""
    (i0, i1), (c0, c1) = rows, cols
    if isinstance(means, QuantisedMeans):
        if fused:
            from ..kernels.block_scores import quantised_scores_triton

            return quantised_scores_triton(means.q_codes, means.q_scale, means.k_codes, means.k_scale, rows, cols)
        return quantised_scores(means, rows, cols)
    if fused:
        from ..kernels.block_scores import pooled_scores_triton

        return pooled_scores_triton(means, k_mean, rows, cols)
    return torch.matmul(means[:, :, i0:i1], k_mean[:, :, c0:c1].transpose(-1, -2)) * (means.shape[-1] ** -0.5)
