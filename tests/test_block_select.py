"""Fused TopK kernel (CPU interpreter) against the stable-sort selection of `routing.select_blocks`.

Selections are integer sets, so they must match exactly: rows with many ties (scores drawn from a
few values, including -0.0 next to 0.0, which the sort treats as equal), scores one ulp apart
(they differ in the last digit of the radix select only), budgets of one block and of a whole
group, several groups, dense query blocks, and group sizes that are not powers of two (145 and
150 are held as a head vector and a quarter-width tail, 178 with a half-width one, 37 in one vector;
`radix_select.row_split`).
"""
import pytest
import torch

from triton_interpreter import kernel_imports

with kernel_imports():
    pytest.importorskip("triton")
    from adaptive_sparse_attention.kernels.triton.block_select import select_blocks_triton

from adaptive_sparse_attention.backend.routing import select_blocks
from adaptive_sparse_attention.kernels.registry import resolve

pytestmark = pytest.mark.usefixtures("interpreter")

CASES = [  # batch, heads, J, groups (lo, hi, budget), number of leading dense query blocks, scores
    (2, 1, 37, [(3, 20, 4), (20, 37, 17)], 3, "ties"),
    (1, 2, 37, [(3, 20, 4), (20, 37, 17)], 0, "normal"),
    (1, 1, 9, [(0, 9, 1)], 0, "ties"),
    (1, 1, 150, [(5, 150, 15)], 5, "normal"),
    (1, 1, 150, [(5, 150, 15)], 5, "ties"),
    (1, 1, 150, [(0, 150, 40)], 0, "ulps"),
    (1, 1, 40, [(3, 40, 37)], 2, "ties"),  # a whole group wider than the head vector, dense rows too
    (1, 1, 180, [(2, 180, 30)], 0, "ties"),
]


@pytest.mark.parametrize("B,H,J,groups,n_dense,kind", CASES)
def test_matches_the_stable_sort_selection(B, H, J, groups, n_dense, kind):
    g = torch.Generator().manual_seed(J + n_dense)
    if kind == "ties":
        levels = torch.tensor([-1.0, -0.0, 0.0, 0.5, 1.0, float("-inf")])
        scores = levels[torch.randint(0, len(levels), (B, H, J, J), generator=g)]
    elif kind == "ulps":  # 1.0 plus 0..63 ulps: equal in the top three bytes of the key
        ulps = torch.randint(0, 64, (B, H, J, J), generator=g, dtype=torch.int32)
        scores = (torch.ones(B, H, J, J).view(torch.int32) + ulps).view(torch.float32)
    else:
        scores = torch.randn(B, H, J, J, generator=g)
    dense_hi = torch.full((J,), groups[0][0], dtype=torch.int32)
    dense_hi[:n_dense] = J
    want, _ = select_blocks(scores, dense_hi, groups)
    got = select_blocks_triton(scores, dense_hi, groups)
    assert got.dtype == torch.int32
    assert torch.equal(got, want)


def test_row_shapes_hold_the_row_and_change_only_at_quarters_of_a_power_of_two():
    """Every row fits its (head, tail) lanes, with fewer than 1.5 lanes a score above 64 scores; a
    power of two holds at most three shapes; the video rows of H3's 10 s and 9.3 s clips (1,134 and
    1,056 key blocks of 64; latent frames 72 and 67) share one, so the second clip builds no new kernel."""
    from adaptive_sparse_attention.kernels.triton.radix_select import row_split

    shapes = {}
    for n in range(1, 5000):
        head, tail = row_split(n)
        assert head & (head - 1) == 0 and tail & (tail - 1) == 0 and n <= head + tail, n
        if n > 64:
            assert head + tail < 1.5 * n, (n, head, tail)
        shapes.setdefault(1 << (n - 1).bit_length(), set()).add((head, tail))
    assert all(len(s) <= 3 for s in shapes.values()), shapes
    assert row_split(1134) == row_split(1056) == (1024, 256)


def test_bad_group_is_named():
    with pytest.raises(ValueError, match="budget=5"):
        select_blocks_triton(torch.zeros(1, 1, 4, 4), torch.zeros(4, dtype=torch.int32), [(0, 4, 5)])


@pytest.mark.parametrize("B,H,J,D", [(1, 2, 70, 128), (2, 1, 9, 40)])
def test_pooled_scores_kernel_matches_float64(monkeypatch, B, H, J, D):
    """The routing's scores on the fused path (CPU interpreter) against the float64 product:
    fp32 accuracy (1e-5 of scores of order 1)."""
    from adaptive_sparse_attention.backend import routing
    from adaptive_sparse_attention.kernels.triton.block_scores import pooled_scores_triton

    g = torch.Generator().manual_seed(J)
    q_mean, k_mean = (torch.randn(B, H, J, D, generator=g) for _ in range(2))
    want = q_mean.double() @ k_mean.double().transpose(-1, -2) * D ** -0.5
    torch.testing.assert_close(pooled_scores_triton(q_mean, k_mean).double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(routing.pooled_scores(q_mean, k_mean, kernels=resolve("triton", torch.device("cpu"), torch.float32, strict=True)).double(), want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="must be fp32"):
        pooled_scores_triton(q_mean.double(), k_mean.double())
