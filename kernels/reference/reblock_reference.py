"""Pure-torch references of the reblock tree's kernels: the `torch` row of its operations.

- `gram_torch` / `metric_project_torch`: the products of the metric features (the twins of
  `reblock_features.gram_triton` / `metric_project_triton`), in the accumulation dtype.
- `partition_level_torch`: one level of the capacity-exact tree split (the twin of
  `reblock_split.partition_level_triton`): every node's split direction from its landmarks (top
  principal direction, refined by balanced 2-means), the projections of its tokens, a split by
  selection (kthvalue, ties by slot) and prefix sums, and the token ids moved by one gather
  inside their parent node through the level's static carry map. No sort anywhere.

A level is any object with the fields of `backend.reblock_schedule.Level` (read, never built here).
"""
from __future__ import annotations

from typing import Any

import torch

from ..reblock_rule import REFINE_STEPS, SQUARINGS
from .planner_reference import accum_dtype

TINY = 1e-30


def feature_dtype(x: torch.Tensor) -> torch.dtype:
    """Storage of the tree features of x: float16, float64 for float64 inputs (the reference)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float16


def moment(a: torch.Tensor) -> torch.Tensor:
    """a^T a / n of rows a [G, n, D] in float64."""
    return (a.transpose(-1, -2) @ a / a.shape[1]).double()


def gram_torch(a: torch.Tensor, factor: torch.Tensor | None = None) -> torch.Tensor:
    """a^T a / n per head of a [G, n, D]: float64 [G, D, D]. With factor [G, D, D] the rows are
    first a L / (|a L| + tiny), in the accumulation dtype."""
    acc = accum_dtype(a)
    if factor is None:
        return moment(a.to(acc))
    s = a.to(acc) @ factor.to(acc)
    return moment(s / (torch.linalg.vector_norm(s, dim=-1, keepdim=True) + TINY))


def metric_project_torch(x: torch.Tensor, factor: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """(x @ proj) / (|x @ factor| + tiny) per row, non-finite entries 0, in `feature_dtype(x)`:
    x [G, N, D]; factor [G, D, D] and proj [G, D, r] (rounded to x's dtype)."""
    D = x.shape[-1]
    acc = accum_dtype(x)
    f = x @ torch.cat([factor, proj], dim=-1).to(x.dtype)
    norm = torch.linalg.vector_norm(f[..., :D], dim=-1, keepdim=True, dtype=acc)
    # non-finite inputs must not reach the split: a NaN projection would break its counts
    return torch.nan_to_num(f[..., D:].to(acc) / (norm + TINY), nan=0.0, posinf=0.0, neginf=0.0).to(feature_dtype(x))


def split_directions(marks: torch.Tensor) -> torch.Tensor:
    """Split direction of every node from its landmarks [G, nodes, m, r] -> unit [G, nodes, r, 1].

    Start: the top principal direction. The centred covariance is scaled to unit Frobenius norm
    (eigenvalues <= 1, the top one >= 1 / sqrt(r), so the power neither overflows nor
    underflows in fp32); the largest column of its 2**SQUARINGS-th power is that eigenvector up
    to scale. Then REFINE_STEPS steps of balanced 2-means: split the landmarks at their median
    projection and point the direction from the lower half's sum to the upper half's, which is
    the split the capacity cut makes (more recall than the principal direction alone).
    """
    centred = marks - marks.mean(2, keepdim=True)
    c = centred.transpose(-1, -2) @ centred
    c = c / torch.linalg.matrix_norm(c, keepdim=True).clamp_min(TINY)
    c = torch.linalg.matrix_power(c, 2 ** SQUARINGS)
    col = torch.linalg.vector_norm(c, dim=-2, keepdim=True).argmax(-1, keepdim=True)
    d = torch.take_along_dim(c, col, dim=-1)
    minus_total = -marks.sum(2).unsqueeze(-1)  # [G, nodes, r, 1]
    median = (marks.shape[2] + 1) // 2  # kthvalue, not median: CUDA median refuses deterministic mode
    for _ in range(REFINE_STEPS):
        s = marks @ d  # [G, nodes, m, 1]
        upper = (s > s.kthvalue(median, dim=2, keepdim=True).values).to(marks.dtype)
        d = torch.add(minus_total, marks.transpose(-1, -2) @ upper, alpha=2)  # upper sum - lower sum
    return d / torch.linalg.vector_norm(d, dim=-2, keepdim=True).clamp_min(TINY)


def token_features(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Feature rows of the token ids [G, ...] of every tree (features z [G, N, r] in token
    order): [G, ..., r] in z's accumulation dtype."""
    G, r = z.shape[0], z.shape[-1]
    rows = torch.gather(z, 1, ids.reshape(G, -1, 1).long().expand(-1, -1, r)).view(*ids.shape, r)
    return rows.to(accum_dtype(z))


def landmark_features(z: torch.Tensor, rows: torch.Tensor, landmarks: torch.Tensor) -> torch.Tensor:
    """Features [G, nodes, m, r] of the tokens in the landmark slots [nodes, m] of every node of
    rows [G, nodes, width] (token ids; features z [G, N, r] in token order)."""
    G, nodes, _ = rows.shape
    return token_features(z, torch.gather(rows, 2, landmarks.view(1, nodes, -1).expand(G, nodes, -1)))


def project(z: torch.Tensor, rows: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """Projections [G, nodes, width] of the tokens `rows` [G, nodes, width] (features z [G, N, r])
    on their node's direction [G, nodes, r]: sum over i of d_i z_i, i ascending, the fused
    kernel's order, so both round alike."""
    zi = token_features(z, rows)
    proj = torch.zeros(rows.shape, dtype=zi.dtype, device=z.device)
    for i in range(z.shape[-1]):
        proj = proj + direction[..., i:i + 1] * zi[..., i]
    return proj


def split(proj: torch.Tensor, level: Any) -> torch.Tensor:
    """Capacity-exact split of every node [G, nodes, width] by projection: the destination slot of
    every slot. The left[i] smallest projections (ties by slot) go first in slot order, then the
    other tokens in slot order, then padding. Selection (kthvalue) and prefix sums, no sort."""
    proj = torch.where(level.valid, proj, level.fill)  # fp32 at least
    tau = proj.kthvalue(level.kth, dim=-1, keepdim=True).values  # left[i]-th smallest token
    less = (proj < tau) & level.valid
    ties = proj == tau  # padding only ties at tau = -inf, where no tie is taken (left = 0)
    go_left = less | (ties & (ties.cumsum(-1) <= level.left - less.sum(-1, keepdim=True)))
    before = go_left.cumsum(-1)
    return torch.where(go_left, before - 1, level.right - before)


def partition_level_torch(z: torch.Tensor, rows: torch.Tensor, level: Any) -> torch.Tensor:
    """The token ids [G, 2 * nodes, next width] of the next level after splitting every node of
    `rows` [G, nodes, width] (features z [G, N, r] in token order)."""
    G = z.shape[0]
    nodes, width, c_w = level.nodes, level.width, level.carry.shape[-1]
    marks = landmark_features(z, rows, level.landmarks)
    dest = split(project(z, rows, split_directions(marks).squeeze(-1)), level)
    slots = torch.arange(width, device=z.device).expand(G, nodes, width)
    src = torch.empty_like(dest).scatter_(2, dest, slots)  # slot before the split of every slot after
    pick = torch.gather(src.unsqueeze(2).expand(G, nodes, 2, width), 3,
                        level.carry.unsqueeze(0).expand(G, nodes, 2, c_w))
    return torch.gather(rows.unsqueeze(2).expand(G, nodes, 2, width), 3, pick).view(G, 2 * nodes, c_w)
