"""Routing (seed 000): block means of Q and K, pooled scores, per-region TopK, index tables.

Every query block of a sparse region keeps, per candidate key region r, the R_r key blocks with
the highest pooled score E = q_mean k_mean^T / sqrt(D) (fp32), where
R_r = max(1, min(J_r, ceil(ratio * J_r))). Ties break toward the lower block index, so the
selection is deterministic and has exactly R_r entries. Context keys are never candidates: they
are always computed exactly (the dense prefix [0, dense_hi) of every query block).
"""
from __future__ import annotations

import math

import torch

from .cache import BoundedCache
from .layout import CONTEXT, TARGET_VIDEO
from .pooling import fused_planner
from .tiling import Tiling

_ROUTES: BoundedCache[tuple[torch.Tensor, tuple[tuple[int, int, int], ...]]] = BoundedCache(16)


def region_budget(num_blocks: int, ratio: float) -> int:
    """R = max(1, min(J, ceil(ratio * J))); the product is rounded to 9 decimals first so that
    e.g. 0.1 * 30 counts as 3, not 4."""
    return max(1, min(num_blocks, math.ceil(round(ratio * num_blocks, 9))))


def pooled_scores(q_mean: torch.Tensor, k_mean: torch.Tensor) -> torch.Tensor:
    """E = q_mean k_mean^T / sqrt(D), fp32 [B, H, J, J] (fp64 for fp64 means). fp32 means on the
    GPU take a Triton kernel on tensor cores at about fp32 accuracy (kernels/block_scores.py)."""
    if fused_planner(q_mean) and q_mean.dtype == torch.float32:
        from ..kernels.block_scores import pooled_scores_triton

        return pooled_scores_triton(q_mean, k_mean)
    return torch.matmul(q_mean, k_mean.transpose(-1, -2)) * (q_mean.shape[-1] ** -0.5)


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
    (lo, hi, budget) that sparse query blocks route over. Cached per (tiling shape, scope, ratio,
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


def select_blocks(scores: torch.Tensor, dense_hi: torch.Tensor, groups: list[tuple[int, int, int]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group TopK for every sparse query block: (q2k_idx [B, H, J, R] int32 ascending with -1
    rows for dense query blocks, q2k_num [B, H, J] int32). R = sum of the group budgets."""
    B, H, J, _ = scores.shape
    sparse = dense_hi < J
    if fused_planner(scores):  # radix-select TopK in one Triton kernel (kernels/block_select.py)
        from ..kernels.block_select import select_blocks_triton

        idx = select_blocks_triton(scores, dense_hi, groups)
    else:
        picks = [topk_blocks(scores[..., lo:hi], budget) + lo for lo, hi, budget in groups]
        idx = torch.sort(torch.cat(picks, dim=-1), dim=-1).values.to(torch.int32)
        idx = torch.where(sparse.view(1, 1, J, 1), idx, torch.full_like(idx, -1))
    num = (sparse.to(torch.int32) * idx.shape[-1]).view(1, 1, J).expand(B, H, J).contiguous()
    return idx.contiguous(), num
