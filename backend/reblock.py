"""Reblock tiling: per-head token layouts that group tokens with similar attention.

Every video region gets a tree: its rows' features under the attention metric
(`reblock_metric.py`) are split by capacity, level by level along the node's principal direction,
into blocks of similar tokens (`reblock_partition.py`, on the shape-only `reblock_schedule.py`; on
the GPU the metric's factor and basis and the partition replay from CUDA graphs: `reblock_graphs.py`).
Context regions keep the 1D chunks of the cube tiling.

Layout modes: `q_reuse_k` builds the key layout and queries reuse it; `independent` builds both
(queries by X_Q, keys by X_K) in one batched run. V always follows K. Then every head keeps its
tree or takes a fixed space-time tube tiling cut into the same blocks, whichever holds more
sampled attention mass (heads that attend by position are served better by tubes;
backend/head_choice.py).
"""
from __future__ import annotations

import torch

from ..errors import SparseAttentionError
from ..kernels.registry import Kernels
from .config import REBLOCK_LAYOUTS
from .head_choice import choose_tubes
from .layout import SequenceLayout
from .reblock_graphs import run_partition
from .reblock_metric import metric_features
from .reblock_schedule import Schedule, cached_static
from .tiling import Tiling


def check_inputs(q: torch.Tensor, k: torch.Tensor, layout: SequenceLayout, block_size: int, layout_mode: str) -> None:
    """Raise ValueError naming the argument and its value when `reblock_tiling` cannot run on these
    inputs (decided from metadata only)."""
    if layout_mode not in REBLOCK_LAYOUTS:
        raise SparseAttentionError(f"reblock_tiling: layout_mode={layout_mode!r} is not allowed: expected one of "
                         + ", ".join(repr(m) for m in REBLOCK_LAYOUTS))
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise SparseAttentionError(f"reblock_tiling: block_size={block_size!r} is not allowed: expected a positive integer")
    if not isinstance(layout, SequenceLayout):
        raise SparseAttentionError(f"reblock_tiling: layout must be a SequenceLayout, got {type(layout).__name__}")
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise SparseAttentionError(f"reblock_tiling: {name} must be a [B, H, S, D] tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if not t.is_floating_point():
            raise SparseAttentionError(f"reblock_tiling: {name}.dtype={t.dtype} is not allowed: expected a floating dtype")
    if q.shape != k.shape or q.dtype != k.dtype or q.device != k.device:
        raise SparseAttentionError(f"reblock_tiling: q and k must share shape, dtype and device, got {tuple(q.shape)} "
                         f"{q.dtype} {q.device} and {tuple(k.shape)} {k.dtype} {k.device}")
    if q.shape[2] != layout.total:
        raise SparseAttentionError(f"reblock_tiling: sequence length {q.shape[2]} does not match the layout's "
                         f"{layout.total} rows ({layout!r})")


def reblock_tiling(q: torch.Tensor, k: torch.Tensor, layout: SequenceLayout, block_size: int,
                   layout_mode: str = "q_reuse_k", ratio: float = 0.1, tubes: bool = True,
                   kernels: Kernels | None = None) -> Tiling:
    """Adaptive per-head tiling of q, k [B, H, S, D] (model order).

    Args:
        q, k: the call's queries and keys.
        layout: their segments; block_size: rows per block.
        layout_mode: "q_reuse_k" (queries reuse the key layout) or "independent".
        ratio: the routing ratio the per-head tube choice scores at.
        tubes: every head keeps the tree or takes a fixed space-time tube, whichever holds more
            sampled attention mass in its routing budget at `ratio` (backend/head_choice.py);
            False keeps the tree for every head.
        kernels: the call's kernels (`kernels/registry.py`; default: the torch reference).
    Returns:
        The tiling; its permutations are [B, H, J * block_size]."""
    check_inputs(q, k, layout, block_size, layout_mode)
    B, H, _, D = q.shape
    static = cached_static(layout, block_size, q.device)
    if B * H == 0:  # an empty batch or no heads: nothing to lay out, every tiling is the same empty one
        empty = torch.empty(B, H, static.block_len.numel() * block_size, dtype=torch.int32, device=q.device)
        return Tiling(block_size, empty, empty, static.block_len, tuple(layout.regions()), static.region_blocks)
    sides = 2 if layout_mode == "independent" else 1
    pieces = []
    for seg, part in zip(layout.regions(), static.parts):
        if not isinstance(part, Schedule):
            pieces.append(part.expand(sides, B, H, -1))
            continue
        qs = q[:, :, seg.start:seg.stop].reshape(B * H, seg.length, D)
        ks = k[:, :, seg.start:seg.stop].reshape(B * H, seg.length, D)
        z = metric_features(ks, qs, kernels, layout.cache)  # keys under the queries' metric
        if sides == 2:
            z = torch.cat([metric_features(qs, ks, kernels, layout.cache), z])  # queries under the keys' metric
        members = run_partition(z, part, block_size, kernels, layout.cache, seg.start).view(sides, B, H, -1)
        pieces.append(torch.where(members >= 0, members + seg.start, members))
    perm = torch.cat(pieces, dim=-1).to(torch.int32)
    if tubes:  # every layout has one target video, its last region
        perm = choose_tubes(q, k, perm, layout, block_size, static.region_blocks[-1], ratio, kernels)
    q_perm = perm[0]
    k_perm = perm[1] if sides == 2 else q_perm
    return Tiling(block_size, q_perm, k_perm, static.block_len, tuple(layout.regions()), static.region_blocks)
