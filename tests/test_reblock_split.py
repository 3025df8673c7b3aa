"""Fused reblock level kernels (CPU interpreter) against the torch levels.

Split: the partition is run twice on the same features and the same (torch) split directions:
every level on the torch path, and every level in the fused kernel, once with nodes held in
registers and with chunks so small that the wide-node path (keys in scratch memory, a sampled
bracket of the threshold or the full chunked counting passes, tie counts carried across chunks)
serves most levels. Both paths project in the same order, so they round alike in the
interpreter and the tilings must be identical: the selection is an exact rank rule
(capacity-many smallest projections, ties by slot), so there is no tolerance. Features include
full ties, three-valued ones, -0.0 next to 0.0, edge blocks and a single-block region.

Directions: the kernel gathers its landmarks' features itself (token ids at shuffled slots);
its products run in another order than torch's, so its directions agree
with `split_directions` up to rounding (fp32, a few ulps of a unit vector: 1e-5) on landmark
sets with a clear top direction, where the 2-means medians are not near-ties; and the whole
fused partition is a capacity-exact tiling that agrees with the torch one almost everywhere.
"""
import pytest
import torch

from triton_interpreter import kernel_imports

with kernel_imports():
    pytest.importorskip("triton")
    from adaptive_sparse_attention.kernels.triton import reblock_split

from adaptive_sparse_attention.backend.reblock_partition import partition
from adaptive_sparse_attention.backend.reblock_schedule import build_schedule
from adaptive_sparse_attention.kernels import reblock_rule
from adaptive_sparse_attention.kernels.reference import reblock_reference
from adaptive_sparse_attention.kernels.registry import resolve

pytestmark = pytest.mark.usefixtures("interpreter")


def features(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(4, n, 4, generator=g)
    z[1] = 0  # every projection ties
    z[2, :, 1:] = 0
    z[2, :, 0] = (torch.arange(n) % 3).float()  # three distinct values
    z[3, ::2] = -0.0
    return z


@pytest.mark.parametrize("n,bs,chunk,wide_chunk,bracket,dtype", [
    (600, 16, 8192, 2048, (4096, 128, 8192), torch.float32), (320, 16, 64, 64, (64, 8, 128), torch.float32),
    (320, 16, 128, 32, (64, 8, 128), torch.float16), (320, 16, 64, 64, (16, 0, 16), torch.float32),
    (320, 16, 64, 64, (64, 48, 512), torch.float32), (97, 8, 16, 16, (16, 2, 16), torch.float16),
    (5, 16, 8192, 2048, (4096, 128, 8192), torch.float32)])
def test_fused_levels_give_the_torch_tiling(monkeypatch, n, bs, chunk, wide_chunk, bracket, dtype):
    """bracket (SAMPLE, MARGIN, CAP) of the wide nodes' threshold: a tight one (the full selection
    runs where the threshold falls outside), a loose one, one too small to hold the keys inside.
    fp16: the features' storage (`reblock_reference.feature_dtype`); both paths project in fp32."""
    z = features(n, seed=n + bs).to(dtype)
    schedule = build_schedule(n, bs, torch.device("cpu"))
    want = partition(z, schedule)
    monkeypatch.setattr(reblock_split, "CHUNK", chunk)
    monkeypatch.setattr(reblock_split, "WIDE_CHUNK", wide_chunk)
    for name, value in zip(("SAMPLE", "MARGIN", "CAP"), bracket):
        monkeypatch.setattr(reblock_split, name, value)
    monkeypatch.setattr(reblock_split, "KEY_BLOCK", 32)  # a wide node's keys from several programs
    monkeypatch.setattr(reblock_split, "FEW_PROGRAMS", 8)  # the tests' trees are few and small
    monkeypatch.setattr(reblock_split, "split_directions_triton", lambda z, rows, landmarks, *_:
                        reblock_reference.split_directions(reblock_reference.landmark_features(z, rows, landmarks)).squeeze(-1))
    got = partition(z, schedule, resolve("triton", torch.device("cpu"), torch.float32, strict=True))
    assert torch.equal(got, want)


@pytest.mark.parametrize("m,r,dtype", [(32, 16, torch.float32), (45, 4, torch.float16), (2048, 16, torch.float32),
                                       (200, 3, torch.float32)])
def test_directions_match_torch(m, r, dtype):
    g = torch.Generator().manual_seed(m + r)
    scale = torch.linspace(3.0, 0.5, r)  # a clear top direction, then smaller ones
    marks = (torch.randn(2, 3, m, r, generator=g) * scale).to(dtype).float()  # features as stored
    marks[1, 2] = 0  # an all-zero node gives a zero direction on both paths
    # the kernel gathers the landmarks itself: put them at shuffled token ids and slots
    ids = torch.randperm(3 * m + 5, generator=g)[:3 * m].view(3, m)
    z = torch.zeros(2, 3 * m + 5, r, dtype=dtype)
    z[:, ids.view(-1)] = marks.view(2, 3 * m, r).to(dtype)
    landmarks = torch.stack([torch.randperm(m + 7, generator=g)[:m] for _ in range(3)])
    rows = torch.zeros(2, 3, m + 7, dtype=torch.int32)
    rows.scatter_(2, landmarks.expand(2, 3, m), ids.to(torch.int32).expand(2, 3, m))
    assert torch.equal(reblock_reference.landmark_features(z, rows, landmarks), marks)
    got = reblock_split.split_directions_triton(z, rows, landmarks, reblock_rule.SQUARINGS, reblock_rule.REFINE_STEPS)
    want = reblock_reference.split_directions(marks).squeeze(-1)
    assert got.shape == want.shape
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_fused_partition_is_a_capacity_exact_tiling_close_to_torch(monkeypatch):
    n, bs = 500, 16
    z = torch.randn(2, n, 16, generator=torch.Generator().manual_seed(1)).half()  # as stored
    schedule = build_schedule(n, bs, torch.device("cpu"))
    want = partition(z, schedule)
    got = partition(z, schedule, resolve("triton", torch.device("cpu"), torch.float32, strict=True))
    for row in got:
        assert torch.equal(row[row >= 0].sort().values, torch.arange(n))
    assert (got == want).double().mean() > 0.99


def test_bad_inputs_are_named():
    rows = torch.zeros(1, 1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="z must be fp16 or fp32"):
        reblock_split.split_directions_triton(torch.zeros(1, 8, 4, dtype=torch.float64), rows, torch.zeros(1, 4).long(), 4, 3)
    with pytest.raises(ValueError, match="landmarks int64"):
        reblock_split.split_directions_triton(torch.zeros(1, 8, 4), rows, torch.zeros(1, 4, dtype=torch.int32), 4, 3)
    sizes = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="z must be fp16 or fp32"):
        reblock_split.split_level_triton(torch.zeros(1, 8, 2, dtype=torch.float64), rows, torch.zeros(1, 1, 2), sizes, sizes, 8)
    with pytest.raises(ValueError, match="direction fp32"):
        reblock_split.split_level_triton(torch.zeros(1, 8, 2), rows, torch.zeros(1, 1, 3), sizes, sizes, 8)
