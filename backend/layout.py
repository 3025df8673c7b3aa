"""`SequenceLayout`: the packed H3 sequence as segments, grouped into attention regions.

A segment is ``(start, stop, kind[, (T, H, W)])`` in the model's token order. Regions are what
the sparse engine reasons about:

- ``context``: text, audio, conditions, reference images; exact for keys and queries.
- ``reference_video``: a reference video (a ``ref_video`` segment, or a ``ref_img`` segment whose
  grid has more than one frame, which is how ComfyUI's H3 packs reference videos).
- ``target_video``: the generated video; exactly one, and video segments need a grid.
Video rows are t-major, then h, then w, as H3 packs them.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from ..errors import SparseAttentionError
from ..kernels.segments import CONTEXT, KINDS, REFERENCE_VIDEO, TARGET_VIDEO, VIDEO_KINDS, Segment
from .cache import ShapeCache


def _segment(index: int, raw: Any) -> Segment:
    where = f"SequenceLayout segment {index} ({raw!r})"
    if not isinstance(raw, (tuple, list)) or len(raw) not in (3, 4):
        raise SparseAttentionError(f"{where}: expected (start, stop, kind) or (start, stop, kind, (T, H, W))")
    start, stop, kind = raw[0], raw[1], raw[2]
    grid = raw[3] if len(raw) == 4 else None
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, stop)) or not 0 <= start < stop:
        raise SparseAttentionError(f"{where}: start and stop must be integers with 0 <= start < stop")
    if not isinstance(kind, str) or kind not in KINDS:
        raise SparseAttentionError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if grid is not None:
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        if len(grid) != 3 or not all(isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in grid):
            raise SparseAttentionError(f"{where}: grid must be three positive integers (T, H, W), got {grid!r}")
        if grid[0] * grid[1] * grid[2] != stop - start:
            raise SparseAttentionError(
                f"{where}: grid {grid} has {grid[0] * grid[1] * grid[2]} cells but the segment has "
                f"{stop - start} rows"
            )
    elif kind in VIDEO_KINDS:
        raise SparseAttentionError(f"{where}: a {kind!r} segment needs its (T, H, W) grid")
    return Segment(start, stop, kind, grid)


class SequenceLayout:
    """Validated segments of one packed sequence and the regions derived from them."""

    def __init__(self, segments: Sequence[Segment]):
        if not isinstance(segments, (tuple, list)) or not all(isinstance(s, Segment) for s in segments):
            raise TypeError("SequenceLayout(segments) takes a list of Segment; build a layout from tuples with "
                            f"SequenceLayout.from_segments, got {type(segments).__name__}")
        self.segments: tuple[Segment, ...] = tuple(segments)
        if not self.segments:
            raise SparseAttentionError("SequenceLayout needs at least one segment")
        expected = 0
        for i, seg in enumerate(self.segments):
            if seg.start != expected:
                what = "overlaps the previous one" if seg.start < expected else "leaves a gap after the previous one"
                raise SparseAttentionError(
                    f"SequenceLayout segment {i} starts at {seg.start} and {what} (expected start {expected}); "
                    "segments must be sorted, contiguous and non-overlapping from row 0"
                )
            expected = seg.stop
        targets = [s for s in self.segments if s.region == TARGET_VIDEO]
        if len(targets) != 1:
            raise SparseAttentionError(
                f"SequenceLayout needs exactly one target 'video' segment, found {len(targets)}"
            )
        self.total: int = expected
        self.cache = ShapeCache()  # what is built for this layout's shape; not part of its value

    @classmethod
    def from_segments(cls, segments: Iterable[Any]) -> "SequenceLayout":
        """Build from ``(start, stop, kind[, (T, H, W)])`` tuples in token order."""
        if isinstance(segments, (str, bytes, dict)) or not isinstance(segments, Iterable):
            raise TypeError("SequenceLayout.from_segments takes a list of (start, stop, kind[, (T, H, W)]) tuples, "
                            f"got {type(segments).__name__}")
        return cls([_segment(i, raw) for i, raw in enumerate(segments)])

    @classmethod
    def from_packed(cls, packed: Any) -> "SequenceLayout":
        """Build from ComfyUI's H3 ``PackedLayout`` (its ``segments`` and ``position_ids``).

        Grids come from the distinct (t, h, w) coordinates of each segment's rows; a ``ref_img``
        segment spanning several t values is a reference video.
        """
        pos = getattr(packed, "position_ids", None)
        if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[1] != 3:
            raise SparseAttentionError("SequenceLayout.from_packed: position_ids must be a [S, 3] tensor of (t, h, w)")
        raw = []
        for start, stop, kind in packed.segments:
            grid = None
            if kind in ("video", "ref_img"):
                rows = pos[start:stop]
                grid = tuple(int(torch.unique(rows[:, axis]).numel()) for axis in range(3))
                if kind == "ref_img" and grid[0] == 1:
                    grid = None  # a single reference image is context
            raw.append((int(start), int(stop), kind, grid))
        return cls.from_segments(raw)

    def regions(self) -> list[Segment]:
        """Segments in attention-block order: context first, then reference videos, then target."""
        order = {CONTEXT: 0, REFERENCE_VIDEO: 1, TARGET_VIDEO: 2}
        return sorted(self.segments, key=lambda s: (order[s.region], s.start))

    @property
    def target(self) -> Segment:
        """The target-video segment (exactly one, checked at construction)."""
        return next(s for s in self.segments if s.region == TARGET_VIDEO)

    def rows_of(self, region: str) -> torch.Tensor:
        """Model-order row indices of every segment in `region` (int64)."""
        parts = [torch.arange(s.start, s.stop) for s in self.segments if s.region == region]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def signature(self) -> tuple:
        """A hashable value equal for equal layouts (equality and hash; the cache is not part of it)."""
        return tuple((s.start, s.stop, s.kind, s.grid) for s in self.segments)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SequenceLayout) and self.signature() == other.signature()

    def __hash__(self) -> int:
        return hash(self.signature())

    def __repr__(self) -> str:
        body = ", ".join(f"{s.kind}[{s.start}:{s.stop}]" + (f"{s.grid}" if s.grid else "") for s in self.segments)
        return f"SequenceLayout({body})"
