"""The sampled estimate of a sparse call's error (backend/fidelity.py) and its place in `sparse_attention`.

The sampled rows' exact output is float64 dense attention for those rows; the rows are deterministic,
stratified over the sparse (video) regions only, different per head, rotate with the rotation and
cover every video block over enough rotations; edge blocks shorter than the block keep their true
length. With `measure_error` off nothing is computed.
"""
from __future__ import annotations

import pytest
import torch

from adaptive_sparse_attention import SequenceLayout, SparseConfig, sparse_attention
from adaptive_sparse_attention.backend import attention as attention_module
from adaptive_sparse_attention.backend.fidelity import (ROWS, coprime_stride, exact_rows, sample_rows, sampled_error,
                                                        sparse_regions)
from layouts import awkward_layout

ODD = SequenceLayout.from_segments([(0, 23, "text"), (23, 58, "audio"), (58, 58 + 3 * 7 * 11, "video", (3, 7, 11))])
SCOPES = ("target-video", "joint-video")


def qkv(layout: SequenceLayout, heads: int = 2, dim: int = 32, dtype: torch.dtype = torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, layout.total, dim, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))


def dense64(q, k, v):
    q, k, v = (t.double() for t in (q, k, v))
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v


def sparse_rows(layout: SequenceLayout, scope: str) -> set[int]:
    return {r for s in sparse_regions(layout, scope) for r in range(s.start, s.stop)}


def blocks_of(layout: SequenceLayout, scope: str) -> set[tuple[int, int]]:
    """(segment start, block) of every sampled-size block of the sparse regions."""
    return {(s.start, j) for s in sparse_regions(layout, scope) for j in range(-(-s.length // ROWS))}


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("layout,scope", [(ODD, "target-video"), (awkward_layout(), "joint-video")])
def test_sampled_rows_are_dense_attention_in_float64(layout, scope, heads):
    q, k, v = qkv(layout, heads)
    rows = sample_rows(layout, heads, 3, scope)
    got = exact_rows(q, k, v, rows)
    ref = dense64(q, k, v)
    valid = rows >= 0
    for h in range(heads):
        want = ref[:, h, rows[h][valid[h]]]
        torch.testing.assert_close(got[:, h][:, valid[h]], want, rtol=1e-12, atol=1e-12)
    out = sparse_attention(q, k, v, layout, SparseConfig(topk_ratio=0.2, tiling="cube", sparse_scope=scope,
                                                         kernel="torch"))
    sample = sampled_error(q, k, v, out, layout, 3, scope)
    for h in range(heads):
        picked = rows[h][valid[h]]
        diff = (out[:, h, picked] - ref[:, h, picked]).pow(2).sum()
        torch.testing.assert_close(sample.sq_diff[h], diff, rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(sample.sq_exact[h], ref[:, h, picked].pow(2).sum(), rtol=1e-12, atol=0)
    assert sample.sq_diff.dtype == torch.float64 and float(sample.sq_diff.sum()) > 0  # the sparse call is not exact
    exact = sampled_error(q, k, v, ref, layout, 3, scope)  # dense output: no error
    assert float(exact.pooled()) < 1e-12


def test_half_precision_inputs_compute_the_rows_in_float32():
    q, k, v = qkv(ODD, 2, dtype=torch.bfloat16)
    rows = sample_rows(ODD, 2, 0, "target-video")
    got = exact_rows(q, k, v, rows)
    assert got.dtype == torch.float32
    want = dense64(q, k, v).gather(2, rows.clamp_min(0).view(1, 2, -1, 1).expand_as(got))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_estimate_is_deterministic():
    layout = awkward_layout()
    q, k, v = qkv(layout, 2)
    out = sparse_attention(q, k, v, layout, SparseConfig(topk_ratio=0.2, tiling="cube", kernel="torch"))
    a, b = (sampled_error(q, k, v, out, layout, 7, "joint-video") for _ in range(2))
    assert torch.equal(a.rows, b.rows) and torch.equal(a.sq_diff, b.sq_diff) and torch.equal(a.sq_exact, b.sq_exact)


@pytest.mark.parametrize("heads", [1, 2, 5])
@pytest.mark.parametrize("layout,scope", [(ODD, "target-video"), (awkward_layout(), "target-video"),
                                          (awkward_layout(), "joint-video")])
def test_rows_are_video_blocks_that_rotate_and_cover_every_block(layout, scope, heads):
    allowed, every = sparse_rows(layout, scope), blocks_of(layout, scope)
    starts = sorted(s.start for s in sparse_regions(layout, scope))
    seen = [set() for _ in range(heads)]
    previous = None
    for rotation in range(len(every)):
        rows = sample_rows(layout, heads, rotation, scope)
        assert rows.dtype == torch.long and rows.shape[0] == heads
        for h in range(heads):
            picked = rows[h][rows[h] >= 0].tolist()
            assert set(picked) <= allowed, "a row outside the sparse video regions (context or audio) was sampled"
            for r in picked:
                start = max(s for s in starts if s <= r)
                seen[h].add((start, (r - start) // ROWS))
        if previous is not None:
            assert not torch.equal(rows, previous), f"rotation {rotation} samples the rows of the one before"
        previous = rows
    for h in range(heads):
        assert seen[h] == every, f"head {h} missed blocks {sorted(every - seen[h])}"


def test_heads_sample_different_blocks_and_edge_blocks_keep_their_length():
    rows = sample_rows(ODD, 2, 0, "target-video")
    assert not torch.equal(rows[0], rows[1])
    video = ODD.target
    last = (video.length - 1) // ROWS  # the short edge block: 231 rows = 3 x 64 + 39
    for rotation in range(8):
        rows = sample_rows(ODD, 2, rotation, "target-video")
        for h in range(2):
            for block in rows[h].view(-1, ROWS):  # one sampled block per ROWS columns
                kept = block[block >= 0]
                first = (int(kept[0]) - video.start) // ROWS
                assert kept.tolist() == list(range(video.start + first * ROWS, video.start + first * ROWS + len(kept)))
                assert len(kept) == (video.length - last * ROWS if first == last else ROWS)
                assert (block[len(kept):] == -1).all()


def test_the_stride_visits_every_block():
    for n in range(1, 40):
        stride = coprime_stride(n)
        assert sorted(i * stride % n for i in range(n)) == list(range(n))


def test_sparse_attention_reports_the_estimate_and_feeds_the_sink():
    layout = awkward_layout()
    q, k, v = qkv(layout, 2)
    config = SparseConfig(topk_ratio=0.2, tiling="cube", sparse_scope="joint-video", kernel="torch")
    got = []
    out, info = sparse_attention(q, k, v, layout, config, return_info=True, error_rotation=4,
                                 error_sink=lambda d, e: got.append((d, e)))
    sample = sampled_error(q, k, v, out, layout, 4, "joint-video")
    (d, e), = got
    assert torch.equal(d, sample.sq_diff) and torch.equal(e, sample.sq_exact)
    assert isinstance(info.sampled_error, float) and info.sampled_error > 0
    assert info.sampled_error == pytest.approx(float((d.sum() / e.sum()).sqrt()), rel=1e-12)
    torch.testing.assert_close(info.sampled_error_heads, (d / e).sqrt())
    got.clear()
    alone = sparse_attention(q, k, v, layout, config, error_rotation=4, error_sink=lambda d, e: got.append((d, e)))
    assert torch.equal(alone, out) and torch.equal(got[0][0], d)  # no info asked: the sink still gets the sums


def test_with_measure_error_off_nothing_is_computed(monkeypatch):
    layout = ODD
    q, k, v = qkv(layout, 2)

    def refuse(*args, **kwargs):
        raise AssertionError("the sampled rows ran with measure_error off")

    monkeypatch.setattr(attention_module, "sampled_error", refuse)
    config = SparseConfig(topk_ratio=0.2, tiling="cube", kernel="torch", measure_error=False)
    sink = []
    out, info = sparse_attention(q, k, v, layout, config, return_info=True, error_sink=lambda *a: sink.append(a))
    assert info.sampled_error is None and info.sampled_error_heads is None and not sink
    sparse_attention(q, k, v, layout, config.replace(measure_error=True))  # nobody reads it: not computed either


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_measure_error_is_validated(value):
    with pytest.raises(ValueError, match=r"SparseConfig\.measure_error.*True or False"):
        SparseConfig(measure_error=value)


def test_the_estimate_traces_under_torch_compile_without_recompiling_per_rotation():
    torch._dynamo.reset()
    q, k, v = qkv(ODD, 2, dtype=torch.float32)
    out = dense64(q, k, v).float() + 0.01
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    compiled = torch.compile(lambda r: sampled_error(q, k, v, out, ODD, r).sq_diff, backend=backend, fullgraph=True)
    for rotation in range(4):
        torch.testing.assert_close(compiled(rotation), sampled_error(q, k, v, out, ODD, rotation).sq_diff)
    assert len(frames) <= 2, f"{len(frames)} graphs for 4 rotations"  # the first value, then one dynamic int
    torch._dynamo.reset()


def test_the_error_estimate_command_passes_where_it_samples_every_row_and_fails_past_its_bound(capsys, monkeypatch):
    """`error-estimate` at demo size with one sampled block of all 2,304 video rows per head: the estimate is the
    true error (est/true 1.000, the heads ranked alike), so the verdict is PASS and the exit code 0; the same run
    against a ratio bound below zero is a FAIL with exit code 1."""
    from adaptive_sparse_attention.bench import error_estimate
    from adaptive_sparse_attention.bench.cli import main

    args = ["error-estimate", "--size", "demo", "--heads", "2", "--scenes", "pan", "--ratios", "0.2", "--rotations",
            "1", "--strata", "1", "--rows", "2304", "--kernel", "torch", "--device", "cpu"]
    code = main(args)
    out = capsys.readouterr().out
    assert out.startswith("demo with 2 heads, tiling reblock: 2304 sampled rows per head and call"), out
    assert "| scene | ratio | true err | est (1) | est/true (1) | rank (1) |" in out, out
    row = next(line for line in out.splitlines() if line.startswith("| pan | 0.2 |")).split(" | ")
    assert row[2] == row[3] and row[4] == "1.000" and row[5].startswith("1.00"), row
    assert code == 0 and out.rstrip().endswith("PASS"), out
    monkeypatch.setattr(error_estimate, "RATIO_BOUND", -1.0)
    code = main(args)
    out = capsys.readouterr().out
    assert code == 1 and out.rstrip().endswith("FAIL"), out
