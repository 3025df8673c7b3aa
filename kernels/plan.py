"""`BlockSparsePlan`: the one plan every block-sparse kernel consumes, and the pack/unpack mapping.

Like FlexAttention's BlockMask, the sparse structure is a handful of small tensors, checked once
when the plan is made (from metadata only: nothing is read from the device):

- `Tiling`: the token layout. q_perm, k_perm int32 [Bp, Hp, J * block_size] map a tiled slot to the
  model-order row it holds (destination -> source, -1 for padding; Bp is 1 or B, Hp is 1 or H; V
  follows K). block_len int32 [J]: valid rows of every block (valid rows come first). `regions` and
  `region_blocks` name the layout's segments in block order and their [lo, hi) block ranges.
- dense_hi int32 [J]: query block i attends exactly to every key block j < dense_hi[i] (context
  first in block order, so this is the "always exact" prefix); dense_hi[i] == J is a dense row.
- q2k_idx int16 (while J < 2**15, half the memory of the planner's largest table at long clips)
  or int32 [B, H, J, R]: selected key blocks, ascending, all >= dense_hi[i], -1 padded;
  q2k_num int32 [B, H, J]: how many entries of a row are valid. `groups`: the `RoutingGroup`s
  (candidate key block range and budget) that routing chose from.
- The tail, exactly one of: none; `QuerySummaries` (every query scores a summary key per unselected
  candidate block); `BlockSummaries` (one summary result per query block).
All attention terms (exact keys and summaries) share one softmax, normalised once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import torch

from ..errors import SparseAttentionError
from .segments import Segment

EMPTY_ROW_LSE = -1.0e30  # log-sum-exp reported for a row that may attend to nothing (finite)
INDEX_DTYPES = (torch.int16, torch.int32)


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {t.dtype} on {t.device}"
    return type(t).__name__


def _require(ok: bool, owner: str, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise SparseAttentionError(f"{owner}: {name} {_describe(value)} is not allowed: expected {expected}")


def _is(t: Any, dtypes: tuple[torch.dtype, ...], dim: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in dtypes and t.dim() == dim


class RoutingGroup(NamedTuple):
    """One TopK group of the routing: every sparse query block keeps the `budget` best key blocks
    of the candidate range [lo, hi)."""

    lo: int
    hi: int
    budget: int


@dataclass(frozen=True)
class Tiling:
    """A block layout: which model-order rows every block slot holds, for queries and keys."""

    block_size: int
    q_perm: torch.Tensor
    k_perm: torch.Tensor
    block_len: torch.Tensor
    regions: tuple[Segment, ...] = ()  # the layout's segments in block order
    region_blocks: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        bs = self.block_size
        _require(isinstance(bs, int) and not isinstance(bs, bool) and bs >= 1, "Tiling", "block_size", bs,
                 "a positive int")
        _require(_is(self.block_len, (torch.int32,), 1), "Tiling", "block_len", self.block_len, "int32 [J]")
        J = self.block_len.shape[0]
        for name in ("q_perm", "k_perm"):
            t = getattr(self, name)
            _require(_is(t, (torch.int32,), 3) and t.shape[-1] == J * bs and t.device == self.block_len.device,
                     "Tiling", name, t, f"int32 [Bp, Hp, {J * bs}] (J * block_size slots) on {self.block_len.device}")
        _require(len(self.regions) == len(self.region_blocks), "Tiling", "regions", self.regions,
                 f"one segment per region block range ({len(self.region_blocks)})")
        ends = [lo for lo, _ in self.region_blocks[:1]] + [hi for _, hi in self.region_blocks]
        contiguous = all(hi >= lo for lo, hi in self.region_blocks) and all(
            a == b for (_, a), (b, _) in zip(self.region_blocks, self.region_blocks[1:]))
        _require(not self.region_blocks or (ends[0] == 0 and ends[-1] == J and contiguous), "Tiling",
                 "region_blocks", self.region_blocks, f"adjacent [lo, hi) ranges covering [0, {J})")

    @property
    def num_blocks(self) -> int:
        """J, the number of blocks."""
        return int(self.block_len.shape[0])

    def __repr__(self) -> str:
        shared = "shared" if self.q_perm is self.k_perm else "separate"
        return (f"Tiling(J={self.num_blocks}, block_size={self.block_size}, perms {tuple(self.q_perm.shape)} {shared}, "
                f"regions={[getattr(seg, 'region', seg) for seg in self.regions]}, on {self.block_len.device})")

    def blocks_of(self, region: str) -> tuple[int, int]:
        """[lo, hi) block range covering every region of one kind (they are adjacent)."""
        spans = [rb for seg, rb in zip(self.regions, self.region_blocks) if seg.region == region]
        if not spans:
            return (0, 0)
        return (spans[0][0], spans[-1][1])


@dataclass(frozen=True)
class QuerySummaries:
    """Per-query tail: every query row scores the summary key of each unselected candidate block.

    key, value: [B, H, J, D] (stored dtype); bias: [B, H, J] fp32 natural-log mass bias."""

    key: torch.Tensor
    value: torch.Tensor
    bias: torch.Tensor

    def __repr__(self) -> str:
        return f"QuerySummaries(key {_describe(self.key)})"


@dataclass(frozen=True)
class BlockSummaries:
    """Per-query-block tail: the summaries of each query block reduced once, at its mean query.

    logit: [B, H, J] fp32 log-mass (-inf: no summary); value: [B, H, J, D] fp32 normalised value."""

    logit: torch.Tensor
    value: torch.Tensor

    def __repr__(self) -> str:
        return f"BlockSummaries(value {_describe(self.value)})"


Tail = Union[QuerySummaries, BlockSummaries, None]


@dataclass(frozen=True)
class BlockSparsePlan:
    """The plan: a tiling, the exact prefix, the selected key blocks and the tail (see the module)."""

    tiling: Tiling
    dense_hi: torch.Tensor
    q2k_idx: torch.Tensor
    q2k_num: torch.Tensor
    groups: tuple[RoutingGroup, ...] = ()
    tail: Tail = None

    def __post_init__(self) -> None:
        owner = "BlockSparsePlan"
        _require(isinstance(self.tiling, Tiling), owner, "tiling", self.tiling, "a Tiling")
        J, dev = self.num_blocks, self.block_len.device
        _require(_is(self.dense_hi, (torch.int32,), 1) and self.dense_hi.shape[0] == J and self.dense_hi.device == dev,
                 owner, "dense_hi", self.dense_hi, f"int32 [{J}] on {dev}")
        idx, num = self.q2k_idx, self.q2k_num
        _require(_is(idx, INDEX_DTYPES, 4) and idx.shape[2] == J and idx.device == dev, owner, "q2k_idx", idx,
                 f"int16 or int32 [B, H, {J}, R] on {dev}")
        B, H = idx.shape[:2]
        _require(_is(num, (torch.int32,), 3) and tuple(num.shape) == (B, H, J) and num.device == dev, owner,
                 "q2k_num", num, f"int32 [{B}, {H}, {J}] on {dev}")
        for name in ("q_perm", "k_perm"):
            p = getattr(self.tiling, name)
            _require(p.shape[0] in (1, B) and p.shape[1] in (1, H), owner, f"tiling.{name}", p,
                     f"[1 or {B}, 1 or {H}, slots] (q2k_idx has B={B}, H={H})")
        ok = all(isinstance(g, tuple) and len(g) == 3 and all(isinstance(x, int) for x in g) and 0 <= g[0] <= g[1] <= J
                 for g in self.groups)
        _require(isinstance(self.groups, tuple) and ok, owner, "groups", self.groups,
                 f"a tuple of RoutingGroup(lo, hi, budget) ints with 0 <= lo <= hi <= {J}")
        object.__setattr__(self, "groups", tuple(RoutingGroup(*g) for g in self.groups))
        tail = self.tail
        if isinstance(tail, QuerySummaries):
            shape = tuple(tail.key.shape[:3])
            fits = (tail.key.dim() == tail.value.dim() == 4 and shape == (B, H, J) and tail.value.shape == tail.key.shape
                    and tuple(tail.bias.shape) == (B, H, J) and tail.bias.is_floating_point()
                    and tail.key.device == tail.value.device == tail.bias.device == dev)
            _require(fits, owner, "tail (query summaries) key", tail.key,
                     f"key and value [{B}, {H}, {J}, D] and a floating bias [{B}, {H}, {J}], on {dev}")
        elif isinstance(tail, BlockSummaries):
            fits = (tail.value.dim() == 4 and tuple(tail.value.shape[:3]) == (B, H, J)
                    and tuple(tail.logit.shape) == (B, H, J) and tail.logit.is_floating_point()
                    and tail.logit.device == tail.value.device == dev)
            _require(fits, owner, "tail (block summaries) value", tail.value,
                     f"logit [{B}, {H}, {J}] and value [{B}, {H}, {J}, D], on {dev}")
        else:
            _require(tail is None, owner, "tail", tail, "None, QuerySummaries or BlockSummaries")

    @property
    def block_size(self) -> int:
        """The tiling's block size (kernels read the tiling's fields through the plan)."""
        return self.tiling.block_size

    @property
    def q_perm(self) -> torch.Tensor:
        """The tiling's query permutation [Bp, Hp, J * block_size]."""
        return self.tiling.q_perm

    @property
    def k_perm(self) -> torch.Tensor:
        """The tiling's key (and value) permutation [Bp, Hp, J * block_size]."""
        return self.tiling.k_perm

    @property
    def block_len(self) -> torch.Tensor:
        """The tiling's block lengths, int32 [J]."""
        return self.tiling.block_len

    @property
    def num_blocks(self) -> int:
        """J, the number of blocks."""
        return self.tiling.num_blocks

    def __repr__(self) -> str:
        B, H, J, R = self.q2k_idx.shape
        groups = ", ".join(f"[{g.lo}:{g.hi}] top {g.budget}" for g in self.groups)
        return (f"BlockSparsePlan(B={B}, H={H}, J={J}, R={R}, block_size={self.block_size}, groups=({groups}), "
                f"tail={self.tail!r}, on {self.block_len.device})")

    def density(self) -> float:
        """Fraction of all (query, key) token pairs computed exactly, averaged over batch and heads.

        Counted from the index tables in O(B x H x J x R) (the dense prefix through a prefix sum of
        the block lengths), never from J x J masks; reading the result synchronises once. The
        sequence length is the tiling's row count (every model row sits in one block)."""
        n = self.block_len.to(torch.float64)
        prefix = torch.cat([n.new_zeros(1), n.cumsum(0)])
        R = self.q2k_idx.shape[-1]
        picked = (torch.arange(R, device=n.device) < self.q2k_num.unsqueeze(-1)) & (self.q2k_idx >= 0)
        keys = prefix[self.dense_hi.long()] + torch.where(picked, n[self.q2k_idx.long().clamp(min=0)], 0.0).sum(-1)
        pairs = (keys * n).sum(-1)
        return float(pairs.mean() / prefix[-1] ** 2) if pairs.numel() else 0.0  # no batch or heads: none

    def selected_mask(self, rows: slice = slice(None)) -> torch.Tensor:
        """bool [B, H, J, J]: key block j selected (by TopK) for query block i; `rows` picks
        query blocks (callers that must stay linear in J take a few at a time)."""
        return selected_mask(self.q2k_idx, self.q2k_num, rows)

    def allowed_mask(self, rows: slice = slice(None)) -> torch.Tensor:
        """bool [B, H, J, J]: key blocks computed exactly (dense prefix or selected)."""
        cols = torch.arange(self.num_blocks, device=self.dense_hi.device)
        return (cols.view(1, -1) < self.dense_hi[rows].view(-1, 1)) | self.selected_mask(rows)

    def summary_mask(self, rows: slice = slice(None)) -> torch.Tensor:
        """bool [B, H, J, J]: candidate key blocks that are represented by their summary."""
        return summary_mask(self.dense_hi, self.q2k_idx, self.q2k_num, rows)

    def flatten(self) -> tuple[list[torch.Tensor], int, list[int], str]:
        """The plan as a custom op's arguments: (tensors, block_size, groups as lo, hi, budget
        ints, tail kind "none" / "query" / "block"); `unflatten` is its inverse."""
        tensors = [self.q_perm, self.k_perm, self.block_len, self.dense_hi, self.q2k_idx, self.q2k_num]
        kind = "none"
        if isinstance(self.tail, QuerySummaries):
            tensors, kind = tensors + [self.tail.key, self.tail.value, self.tail.bias], "query"
        elif isinstance(self.tail, BlockSummaries):
            tensors, kind = tensors + [self.tail.logit, self.tail.value], "block"
        return tensors, self.block_size, [x for g in self.groups for x in g], kind

    @classmethod
    def unflatten(cls, tensors: list[torch.Tensor], block_size: int, groups: list[int], kind: str
                  ) -> "BlockSparsePlan":
        """The plan `flatten` took apart (its tiling without region names), not checked again: it
        was checked when it was made."""
        q_perm, k_perm, block_len, dense_hi, q2k_idx, q2k_num, *tail = tensors
        summaries = {"none": lambda: None, "query": lambda: QuerySummaries(*tail), "block": lambda: BlockSummaries(*tail)}
        tiling = object.__new__(Tiling)
        for name, value in (("block_size", block_size), ("q_perm", q_perm), ("k_perm", k_perm),
                            ("block_len", block_len), ("regions", ()), ("region_blocks", ())):
            object.__setattr__(tiling, name, value)
        plan = object.__new__(cls)
        routing = tuple(RoutingGroup(*groups[i:i + 3]) for i in range(0, len(groups), 3))
        for name, value in (("tiling", tiling), ("dense_hi", dense_hi), ("q2k_idx", q2k_idx), ("q2k_num", q2k_num),
                            ("groups", routing), ("tail", summaries[kind]())):
            object.__setattr__(plan, name, value)
        return plan


def selected_mask(q2k_idx: torch.Tensor, q2k_num: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
    """bool [B, H, n, J]: key block j selected for query block i, for the query blocks `rows`."""
    idx, num = q2k_idx[:, :, rows], q2k_num[:, :, rows]
    B, H, n, R = idx.shape
    J = q2k_idx.shape[2]
    mask = torch.zeros(B, H, n, J + 1, dtype=torch.bool, device=idx.device)
    valid = torch.arange(R, device=mask.device).view(1, 1, 1, R) < num.unsqueeze(-1)
    mask.scatter_(3, torch.where(valid & (idx >= 0), idx.long(), torch.full_like(idx, J).long()), True)
    return mask[..., :J]


def summary_mask(dense_hi: torch.Tensor, q2k_idx: torch.Tensor, q2k_num: torch.Tensor, rows: slice = slice(None)
                 ) -> torch.Tensor:
    """bool [B, H, n, J]: candidate key blocks (at or past the dense prefix) left unselected, so
    represented by their summary, for the query blocks `rows`."""
    cols = torch.arange(dense_hi.shape[0], device=dense_hi.device)
    return (cols.view(1, -1) >= dense_hi[rows].view(-1, 1)) & ~selected_mask(q2k_idx, q2k_num, rows)


def group_span(groups: tuple[RoutingGroup, ...]) -> tuple[int, int]:
    """[first lo, last hi) of routing groups (lo, hi, budget): the query blocks that routing makes
    sparse, each with that span's start as its dense prefix; every other block is dense (the rule of
    `routing.route_plan`, which made the groups). (0, 0) without groups."""
    if not groups:
        return (0, 0)
    return min(g[0] for g in groups), max(g[1] for g in groups)


def perm_heads(perm: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
    """Heads h0:h1 of a [Bp, Hp, L] permutation; a permutation shared by all heads (Hp = 1) as it is."""
    return perm if perm.shape[1] == 1 else perm[:, h0:h1]


def pack(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Rows of x [B, H, S, D] in tiled order [B, H, L, D] (perm [Bp, Hp, L]); padding slots are zero.

    A permutation shared by every batch and head is a plain row gather (`index_select`), much
    cheaper on the GPU than the element-wise gather that per-head permutations need."""
    B, H, S, D = x.shape
    if perm.shape[0] == 1 and perm.shape[1] == 1:
        idx = perm.view(-1)
        return x.index_select(2, idx.clamp(min=0)).masked_fill_((idx < 0).view(1, 1, -1, 1), 0)
    idx = perm.long().expand(B, H, -1)
    rows = torch.gather(x, 2, idx.clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, D))
    return rows.masked_fill((idx < 0).unsqueeze(-1), 0)


def unpack(y: torch.Tensor, perm: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Inverse of `pack`: tiled rows [B, H, L, D] back to model order [B, H, seq_len, D]."""
    B, H, L, D = y.shape
    idx = perm.long().expand(B, H, -1)
    target = torch.where(idx >= 0, idx, torch.full_like(idx, seq_len))  # padding lands in a spare row
    out = y.new_zeros(B, H, seq_len + 1, D)
    out.scatter_(2, target.unsqueeze(-1).expand(-1, -1, -1, D), y)
    return out[:, :, :seq_len]
