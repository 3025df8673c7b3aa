"""The layout's vocabulary that the plan names too: a `Segment` of packed rows and its attention region.

A segment is ``(start, stop, kind[, (T, H, W)])`` in the model's token order; `SequenceLayout`
(backend/layout.py) validates them and groups them into regions.
"""
from __future__ import annotations

from dataclasses import dataclass

CONTEXT_KINDS = ("text", "cond", "cond_audio", "ref_img", "ref_audio", "audio", "context")
VIDEO_KINDS = ("video", "ref_video")
KINDS = CONTEXT_KINDS + VIDEO_KINDS

CONTEXT, REFERENCE_VIDEO, TARGET_VIDEO = "context", "reference_video", "target_video"


@dataclass(frozen=True)
class Segment:
    """One contiguous run of rows of one kind; `grid` is (T, H, W) for video rows."""

    start: int
    stop: int
    kind: str
    grid: tuple[int, int, int] | None = None

    @property
    def length(self) -> int:
        """Rows of the segment."""
        return self.stop - self.start

    @property
    def region(self) -> str:
        """The segment's attention region: `video` is the target, `ref_video` or a `ref_img` of
        several frames a reference video, anything else context."""
        if self.kind == "video":
            return TARGET_VIDEO
        if self.kind == "ref_video" or (self.kind == "ref_img" and self.grid is not None and self.grid[0] > 1):
            return REFERENCE_VIDEO
        return CONTEXT
