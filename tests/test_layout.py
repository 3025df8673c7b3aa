"""SequenceLayout: regions from segments and from ComfyUI's PackedLayout; bad layouts are rejected."""
import pytest
import torch

from adaptive_sparse_attention import SequenceLayout


def test_regions_in_block_order():
    lay = SequenceLayout.from_segments([
        (0, 10, "text"), (10, 10 + 2 * 3 * 4, "ref_img", (2, 3, 4)), (34, 40, "ref_img", (1, 2, 3)),
        (40, 50, "audio"), (50, 50 + 3 * 2 * 2, "video", (3, 2, 2))])
    assert lay.total == 62
    assert [s.region for s in lay.segments] == ["context", "reference_video", "context", "context", "target_video"]
    assert [s.kind for s in lay.regions()] == ["text", "ref_img", "audio", "ref_img", "video"]
    assert lay.target.start == 50
    assert lay.rows_of("reference_video").tolist() == list(range(10, 34))


@pytest.mark.parametrize("segments,match", [
    ([(0, 10, "text"), (5, 21, "video", (1, 4, 4))], "overlaps"),
    ([(0, 10, "text"), (12, 28, "video", (1, 4, 4))], "gap"),
    ([(10, 26, "video", (1, 4, 4)), (0, 10, "text")], "starts at 10"),
    ([(0, 10, "text"), (10, 26, "video", (1, 4, 5))], "has 20 cells but the segment has 16 rows"),
    ([(0, 10, "text")], "exactly one target 'video' segment, found 0"),
    ([(0, 16, "video", (1, 4, 4)), (16, 32, "video", (1, 4, 4))], "found 2"),
    ([(0, 16, "video")], "needs its \\(T, H, W\\) grid"),
    ([(0, 16, "pixels")], "kind 'pixels' is not one of"),
    ([(0, 0, "text")], "0 <= start < stop"),
    ([], "at least one segment"),
])
def test_bad_layouts_raise_clearly(segments, match):
    with pytest.raises(ValueError, match=match):
        SequenceLayout.from_segments(segments)


class FakePackedLayout:
    """Shaped like ComfyUI's H3 PackedLayout: (start, stop, kind) segments, [S, 3] (t, h, w) positions."""

    def __init__(self, text, ref_video, ref_image, audio, video):
        segs, pos, row = [], [], 0

        def add(kind, n, p):
            nonlocal row
            segs.append((row, row + n, kind))
            pos.append(p)
            row += n

        add("text", text, torch.stack([torch.arange(text, dtype=torch.float64)] + [torch.zeros(text, dtype=torch.float64)] * 2, 1))
        for kind, (T, H, W) in (("ref_img", ref_video), ("ref_img", ref_image), ("audio", (audio, 1, 1)), ("video", video)):
            t, h, w = torch.meshgrid(torch.arange(T) * 1.7, torch.arange(H) * 0.3, torch.arange(W) * 0.2, indexing="ij")
            add(kind, T * H * W, torch.stack([t.reshape(-1), h.reshape(-1), w.reshape(-1)], 1).double())
        self.segments = segs
        self.position_ids = torch.cat(pos)


def test_from_packed_reads_grids_and_reference_videos():
    packed = FakePackedLayout(text=7, ref_video=(3, 2, 4), ref_image=(1, 2, 4), audio=5, video=(4, 3, 5))
    lay = SequenceLayout.from_packed(packed)
    kinds = [(s.kind, s.grid, s.region) for s in lay.segments]
    assert kinds == [("text", None, "context"), ("ref_img", (3, 2, 4), "reference_video"),
                     ("ref_img", None, "context"), ("audio", None, "context"), ("video", (4, 3, 5), "target_video")]
    assert lay.total == packed.position_ids.shape[0]


def test_from_packed_rejects_bad_positions():
    packed = FakePackedLayout(text=3, ref_video=(2, 1, 1), ref_image=(1, 1, 1), audio=2, video=(2, 2, 2))
    packed.position_ids = torch.zeros(5, 2)
    with pytest.raises(ValueError, match="position_ids"):
        SequenceLayout.from_packed(packed)
