"""Token -> block layouts ("tilings") and the pack/unpack mapping they define.

A `Tiling` (`kernels/plan.py`) places every token of a region into fixed-capacity blocks (`block_size` slots).
`q_perm`/`k_perm` map a tiled slot to the model-order row it holds (destination -> source, int32,
`-1` for padding slots, which are never dereferenced). Valid members of a block come first, so a
block's true length `block_len[j]` is enough to mask its padding. Blocks never cross a region
boundary; regions are laid out context first, then reference videos, then the target video.

Cube tiling uses (bT, bH, bW) space-time tiles, ordered t-tile, h-tile, w-tile with
members in t, h, w order; context segments are cut into 1D chunks. The reblock tiling
(`backend/reblock.py`) produces the same structure with data-dependent, per-head permutations.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import SparseAttentionError
from ..kernels.plan import Tiling
from .layout import REFERENCE_VIDEO, TARGET_VIDEO, SequenceLayout

GOLDEN = 0.6180339887498949  # the golden ratio minus one

CUBE_TILES = {64: (4, 4, 4), 128: (4, 4, 8)}


def golden_positions(count: int, length: int | torch.Tensor) -> torch.Tensor:
    """`count` positions spread over [0, length) (int64; `length` may be a column of lengths):
    the fractional parts of 0.5 + j * (golden ratio - 1), which never alias with periodic token
    patterns such as video rows. Deterministic."""
    j = torch.frac(0.5 + GOLDEN * torch.arange(count, dtype=torch.float64))
    return (j * length).long()


def cube_tiles(grid: tuple[int, int, int], tile: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Members of every (bT, bH, bW) tile of a t-major grid: ([J, bT*bH*bW] int64 with -1, [J] lengths).

    Edge tiles hold fewer rows; their members are listed first, padding (-1) last.
    """
    (T, H, W), (a, b, c) = grid, tile
    nt, nh, nw = -(-T // a), -(-H // b), -(-W // c)
    t = torch.arange(nt * a).view(nt, a, 1, 1, 1, 1)
    h = torch.arange(nh * b).view(1, 1, nh, b, 1, 1)
    w = torch.arange(nw * c).view(1, 1, 1, 1, nw, c)
    index = t * (H * W) + h * W + w
    valid = (t < T) & (h < H) & (w < W)
    index = torch.where(valid, index, torch.full_like(index, -1))
    members = index.permute(0, 2, 4, 1, 3, 5).reshape(nt * nh * nw, a * b * c)
    # move padding to the end of each block, keeping member order (stable)
    order = torch.sort((members < 0).to(torch.int8), dim=1, stable=True).indices
    members = torch.gather(members, 1, order)
    return members, (members >= 0).sum(1)


def snake_tiles(grid: tuple[int, int, int], patch: tuple[int, int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Space-time tubes cut like a 1D chunking: ([J, block_size] with -1, [J]), edge block last.

    The grid's (bH, bW) patches are walked row by row, every other row backwards; each patch's
    rows are listed frame by frame, forwards in every other patch and backwards in the others
    (a snake), then the list is cut into blocks. A block is a tube of block_size / (bH * bW)
    frames of one patch, or where a patch's frames run out, the same frames of two neighbouring
    patches; no block jumps across the grid. Every patch gives the same block lengths as
    `chunk_tiles` of the grid's length, so tilings of different patches (and the reblock tree)
    can be mixed per head."""
    (T, H, W), (b, c) = grid, patch
    nw = -(-W // c)
    t = torch.arange(T).view(T, 1, 1)
    h = torch.arange(H).view(1, H, 1)
    w = torch.arange(W).view(1, 1, W)
    row = h // b
    col = torch.where(row % 2 == 0, w // c, nw - 1 - w // c)
    p = row * nw + col
    frame = torch.where(p % 2 == 0, t, T - 1 - t)
    key = ((p * T + frame) * b + h % b) * c + w % c
    rows = torch.sort(key.reshape(-1)).indices  # keys are distinct
    chunks, lengths = chunk_tiles(rows.numel(), block_size)
    return torch.where(chunks >= 0, rows[chunks.clamp(min=0)], chunks), lengths


def snake_perm(layout: SequenceLayout, block_size: int, patch: tuple[int, int]) -> torch.Tensor:
    """One permutation (int32 [J * block_size]) of the whole layout with every video region cut
    into `snake_tiles` of `patch` and context in 1D chunks: the same blocks as the reblock tree's."""
    return assemble(layout, block_size, lambda grid: snake_tiles(grid, patch, block_size))[0]


def chunk_tiles(length: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1D chunks of `block_size` rows; the last one carries the remainder."""
    n = -(-length // block_size)
    idx = torch.arange(n * block_size).view(n, block_size)
    members = torch.where(idx < length, idx, torch.full_like(idx, -1))
    return members, (members >= 0).sum(1)


def assemble(layout: SequenceLayout, block_size: int,
             video_tiles: Callable[[tuple[int, int, int]], tuple[torch.Tensor, torch.Tensor]]
             ) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int], ...]]:
    """One permutation of the whole layout in block order: video regions (reference and target)
    cut by `video_tiles(grid)`, context regions in 1D chunks; each gives (members relative to
    the region start, lengths). Returns (perm int32 [J * block_size], block_len int32 [J],
    region block spans)."""
    perms, lens, spans, lo = [], [], [], 0
    for seg in layout.regions():
        video = seg.region in (REFERENCE_VIDEO, TARGET_VIDEO)
        members, lengths = video_tiles(seg.grid) if video else chunk_tiles(seg.length, block_size)
        perms.append(torch.where(members >= 0, members + seg.start, members))
        lens.append(lengths)
        spans.append((lo, lo + lengths.numel()))
        lo += lengths.numel()
    perm = torch.cat(perms).reshape(-1).to(torch.int32)
    return perm, torch.cat(lens).to(torch.int32), tuple(spans)


def cube_tiling(layout: SequenceLayout, block_size: int = 64, device: torch.device | str = "cpu") -> Tiling:
    """Seed-000 tiling: 3D cubes (`CUBE_TILES` of the block size) for video regions, 1D chunks for
    context; shared by all heads. It depends on the shape only, so the planner caches it."""
    if block_size not in CUBE_TILES:
        raise SparseAttentionError(f"cube tiling: block_size={block_size} is not allowed: expected one of {sorted(CUBE_TILES)}")
    tile = CUBE_TILES[block_size]
    perm, block_len, spans = assemble(layout, block_size, lambda grid: cube_tiles(grid, tile))
    perm = perm.view(1, 1, -1).to(device)
    return Tiling(block_size, perm, perm, block_len.to(device), tuple(layout.regions()), spans)
