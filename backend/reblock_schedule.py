"""The reblock tree's shape-only schedule: its levels, built on the host once per layout.

A region of N rows is ceil(N / block_size) blocks; the root holds all blocks, and every node
splits its blocks into halves (floor, ceil) and its tokens by capacity: the left child takes
exactly its capacity, a multiple of the block size. The region's last block is its edge block
(N mod block_size rows). Leaves are single blocks, in tree order. Every level is a few batched
ops over all (tree, node) pairs: nodes are padded to the level's widest (sizes at one depth
differ by at most one block). A `Level` holds what those ops need that depends only on the
shape (valid slots, selection padding, capacities, landmark slots, the carry map to the next
level); `StaticLayout` holds a layout's schedules and 1D context chunks, kept by the layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import REFERENCE_VIDEO, TARGET_VIDEO, SequenceLayout
from .tiling import chunk_tiles, golden_positions

LANDMARKS = 32  # members per node used to find its split direction (at least) ...
LEVEL_LANDMARKS = 2048  # ... and per level of one tree, so the first, widest splits get more


@dataclass(frozen=True)
class Level:
    """Static slots of one tree level: `nodes` nodes of `width` slots each, tokens first.

    valid: bool [nodes, width], slot holds a token. left: long [nodes, 1], the left child's
    capacity (tokens); right: long [nodes, width], left + slot (where right-going slots start).
    Selection pads every node so that its left[i]-th smallest projection is the kth-smallest
    value of its row: fill [nodes, width] puts -inf in kth - left[i] padding slots and +inf in
    the others. landmarks: long [nodes, marks], slots spread over every node's tokens (an empty
    node's first slot). carry: long [nodes, 2, next width], the slot of its parent (after the
    split) that every slot of the two children takes; padding takes any slot (never read).
    sizes: int32 [2, nodes], tokens and left capacity of every node (the fused split's input).
    """

    nodes: int
    width: int
    marks: int
    kth: int
    valid: torch.Tensor
    fill: torch.Tensor
    left: torch.Tensor
    right: torch.Tensor
    landmarks: torch.Tensor
    carry: torch.Tensor
    sizes: torch.Tensor


@dataclass(frozen=True)
class Schedule:
    """The shape-only part of one region's tree: its levels and the last level's slot that
    every block slot takes (`leaf_slots` [blocks * block_size], the dummy for padding)."""

    levels: tuple[Level, ...]
    leaf_slots: torch.Tensor


def build_schedule(length: int, block_size: int, device: torch.device) -> Schedule:
    """Static tree of a region of `length` rows cut into `block_size` blocks (edge block last)."""
    blocks = -(-length // block_size)
    short = blocks * block_size - length  # rows the edge block lacks

    def tokens(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        edge = ((hi == blocks) & (hi > lo)).long() * short
        return (hi - lo) * block_size - edge

    def width(lo: torch.Tensor, hi: torch.Tensor, tok: torch.Tensor) -> int:
        left = (hi - lo) // 2 * block_size  # the left child never holds the edge block
        return int((tok + left.max() - left).max())  # room for the selection's -inf padding

    lo, hi = torch.zeros(1, dtype=torch.long), torch.full((1,), blocks, dtype=torch.long)
    tok = tokens(lo, hi)
    levels = []
    while int((hi - lo).max()) > 1:
        nodes, w = lo.numel(), width(lo, hi, tok)
        mid = lo + (hi - lo) // 2
        left = (mid - lo) * block_size
        c_lo, c_hi = torch.stack([lo, mid], 1).reshape(-1), torch.stack([mid, hi], 1).reshape(-1)
        c_tok = tokens(c_lo, c_hi)
        c_w = width(c_lo, c_hi, c_tok) if int((c_hi - c_lo).max()) > 1 else int(c_tok.max())
        offset = torch.stack([torch.zeros_like(left), left], 1).view(nodes, 2, 1)
        carry = (offset + torch.arange(c_w)).clamp(max=w - 1)  # in range; padding is never read
        m = max(LANDMARKS, min(w, LEVEL_LANDMARKS // nodes))
        marks = golden_positions(m, tok.view(-1, 1))  # spread over each node's tokens; empty node: slot 0
        t = torch.arange(w)
        kth = int(left.max())
        fill = torch.where(t < (tok + kth - left).view(-1, 1), float("-inf"), float("inf"))
        levels.append(Level(nodes, w, m, kth, (t < tok.view(-1, 1)).to(device), fill.to(device),
                            left.view(-1, 1).to(device), (left.view(-1, 1) + t).to(device),
                            marks.to(device), carry.to(device),
                            torch.stack([tok, left]).to(torch.int32).to(device)))
        lo, hi, tok = c_lo, c_hi, c_tok
    nodes, w = lo.numel(), int(tok.max())
    leaf = hi > lo  # every non-empty node is now one block
    t = torch.arange(block_size)
    slots = torch.arange(nodes).view(-1, 1) * w + t
    slots = torch.where(t < tok.view(-1, 1), slots, torch.full_like(slots, nodes * w))[leaf]
    return Schedule(tuple(levels), slots.reshape(-1).to(device))


@dataclass(frozen=True)
class StaticLayout:
    """Shape-only part of a reblock tiling: per region in block order either the region's tree
    `Schedule` (video) or its 1D chunks as absolute rows [n * block_size] (context), and the
    tiling's block lengths and region block spans. Built on the host once, kept on the device."""

    parts: tuple[Schedule | torch.Tensor, ...]
    block_len: torch.Tensor
    region_blocks: tuple[tuple[int, int], ...]


def build_static(layout: SequenceLayout, block_size: int, device: torch.device) -> StaticLayout:
    """The `StaticLayout` of `layout`: a tree `Schedule` per video region, 1D chunks for context."""
    parts, lens, spans, lo = [], [], [], 0
    for seg in layout.regions():
        members, lengths = chunk_tiles(seg.length, block_size)  # a video region's edge block is last too
        if seg.region in (REFERENCE_VIDEO, TARGET_VIDEO):
            parts.append(build_schedule(seg.length, block_size, device))
        else:
            parts.append(torch.where(members >= 0, members + seg.start, members).reshape(-1).to(device))
        lens.append(lengths)
        spans.append((lo, lo + lengths.numel()))
        lo += lengths.numel()
    return StaticLayout(tuple(parts), torch.cat(lens).to(torch.int32).to(device), tuple(spans))


def cached_static(layout: SequenceLayout, block_size: int, device: torch.device) -> StaticLayout:
    """`build_static`, once per (block size, device), kept by the layout: it is built on the host."""
    return layout.cache.get("reblock_static", (block_size, str(device)), lambda: build_static(layout, block_size, device))
