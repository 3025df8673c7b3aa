"""Per-head tiling choice: the reblock tree or a fixed space-time tube, by sampled block mass.

The tree (backend/reblock.py) groups tokens whose attention wants the same keys, which wins
for heads that attend by content. Heads that attend by position (a local window, a temporal
line) are served better by fixed tubes that keep a token's neighbours in one block, so taking
the better of the two per head raises recall over the tree alone on scenes that mix both
kinds of head.

Rule: sample PROBES target-video queries; for every candidate tiling and head, the share of
those queries' exact softmax mass over the target-video keys that falls in the candidate's R
heaviest target-video key blocks (R the routing budget at the planned ratio), averaged over
the probes. The largest share wins; ties go to the earlier candidate, the tree first. The
tubes are snakes through (bH, bW) patches cut like the tree's blocks (full blocks, one edge
block last: `tiling.snake_tiles`), so heads can mix in one tiling.
"""
from __future__ import annotations

import torch

from ..kernels.registry import Kernels, or_reference
from .layout import SequenceLayout
from .routing import region_budget
from .tiling import golden_positions, snake_perm

TUBES = ((1, 2), (2, 4))  # (bH, bW) patches: tubes of block_size / (bH * bW) frames
PROBES = 64  # sampled target-video queries per head



def tube_perms(layout: SequenceLayout, block_size: int, device: torch.device) -> torch.Tensor:
    """Tube tilings of every video region (context in 1D chunks): int32 [tubes, J * block_size]."""
    return cached_statics(layout, block_size, device)[0]


def probe_rows(layout: SequenceLayout) -> torch.Tensor:
    """PROBES model-order rows spread over the target video (int64, deterministic)."""
    target = layout.target
    return target.start + golden_positions(PROBES, target.length)


def cached_statics(layout: SequenceLayout, block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The tube permutations and the probe rows, built on the host once per (block size, device) and
    kept on the device by the layout (a copy from the host per call would wait for the GPU to drain)."""
    def build() -> tuple[torch.Tensor, torch.Tensor]:
        perms = [snake_perm(layout, block_size, patch) for patch in TUBES]
        return torch.stack(perms).to(device), probe_rows(layout).to(device)

    return layout.cache.get("tube_statics", (block_size, str(device)), build)


def block_log_mass(probes: torch.Tensor, k: torch.Tensor, perm: torch.Tensor, block_size: int,
                   kernels: Kernels | None = None) -> torch.Tensor:
    """log sum_i exp(q . k_i / sqrt(D)) of every probe q [G, P, D] over the rows of every key
    block of k [G, S, D] listed by perm [Gp, n * block_size] (Gp in {1, G}, -1 pads): [G, P, n]
    in k's accumulation dtype (`kernels.block_log_mass`)."""
    return or_reference(kernels).block_log_mass(probes, k, perm, block_size)


def top_share(log_mass: torch.Tensor, budget: int, kernels: Kernels | None = None) -> torch.Tensor:
    """Mean over probes of the mass share in the `budget` heaviest blocks: [..., P, n] -> [...]."""
    return or_reference(kernels).top_share(log_mass, budget).mean(-1)


def choose_tubes(q: torch.Tensor, k: torch.Tensor, tree: torch.Tensor, layout: SequenceLayout, block_size: int,
                 span: tuple[int, int], ratio: float, kernels: Kernels | None = None) -> torch.Tensor:
    """Per head, the tree's permutations or the best tube's, by the rule of the module docstring.

    Args:
        q, k: the call's queries and keys [B, H, S, D], model order.
        tree: the tree's permutations [sides, B, H, L]; the last side is the key layout the rule
            scores, and every side of a head takes that head's choice.
        layout, block_size: the call's layout and block size (the tubes are cut from them).
        span: the target video's [lo, hi) blocks.
        ratio: the routing ratio whose budget the shares are taken at.
        kernels: the call's kernels (`kernels/registry.py`; default: the torch reference).
    Returns:
        The chosen permutations, tree's shape and dtype.
    """
    sides, B, H, L = tree.shape
    D = q.shape[-1]
    lo, hi = span
    budget = region_budget(hi - lo, ratio)
    if budget == hi - lo:  # every candidate holds all the mass
        return tree
    tubes, rows = cached_statics(layout, block_size, q.device)
    window = slice(lo * block_size, hi * block_size)
    probes = q.index_select(2, rows).reshape(B * H, PROBES, D)
    keys = k.reshape(B * H, -1, D)
    candidates = [tree[-1].reshape(B * H, L)] + [t.view(1, L) for t in tubes]
    share = top_share(torch.stack([block_log_mass(probes, keys, c[:, window], block_size, kernels) for c in candidates]),
                      budget, kernels)  # one TopK over every candidate
    pick = share.argmax(0).view(1, B, H, 1)  # the first of equal shares
    chosen = tubes.index_select(0, (pick - 1).clamp(min=0).view(-1)).view(1, B, H, L)
    return torch.where(pick == 0, tree, chosen)
