"""Streamed routing (`routing.route_blocks`) against today's full-matrix selection, and 8-bit scores.

Selections are integer sets and must match exactly. Today's selection is
`select_blocks(pooled_scores(q_mean, k_mean))`: on the GPU the Triton tf32x3 score tiles and the
radix-select kernel, elsewhere a torch matmul and a stable sort (the radix select equals the sort
on the same scores: tests/test_block_select.py). The streamed path computes the scores in row
chunks of whole 64-block tiles; it is checked with chunks of one tile (several chunks per call)
on awkward sizes: edge tiles (J not a multiple of 64), several groups, budgets of 1 and of a
whole group, dense query blocks inside the chunks, and exact ties built on purpose (repeated and
zero key means, so equal scores are equal in every bit). The Triton kernels run where this process
runs them (`triton_device`): compiled on a CUDA GPU, else in the CPU interpreter.
"""
import pytest
import torch

from triton_interpreter import kernel_imports

with kernel_imports():  # the kernels must be first imported in this machine's mode
    pytest.importorskip("triton")
    from adaptive_sparse_attention.kernels.triton import block_select  # noqa: F401  (the table imports it when it resolves Triton)
    from adaptive_sparse_attention.kernels.triton.block_scores import pooled_scores_triton, quantised_scores_triton

from adaptive_sparse_attention.backend import indexer, pooling, routing, tail
from adaptive_sparse_attention.backend.routing import pooled_scores, route_blocks, select_blocks
from adaptive_sparse_attention.kernels.plan import BlockSparsePlan, Tiling
from adaptive_sparse_attention.kernels.reference.planner_reference import quantised_scores_torch
from adaptive_sparse_attention.kernels.registry import resolve

CASES = [  # B, H, J, D, groups (lo, hi, budget), leading dense query blocks
    (1, 2, 150, 64, [(5, 70, 1), (70, 150, 80)], 5),  # R = 1 and R = J_r, rows 0..4 dense
    (2, 1, 131, 32, [(3, 20, 4), (20, 131, 12)], 20),  # the first chunk's rows are partly dense
    (1, 1, 150, 32, [(70, 150, 8)], 0),  # sparse rows before the first candidate tile (columns from 64)
]


def means(B, H, J, D, seed, dtype=torch.float32, device="cpu"):
    """Block means with exact ties: every third key mean repeats an earlier one, some are zero."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, J, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, J, D, generator=g, dtype=dtype)
    k[:, :, 2::3] = k[:, :, 1::3][:, :, : k[:, :, 2::3].shape[2]]
    k[:, :, 7::11] = 0
    return q.to(device), k.to(device)


def dense_hi_of(J, groups, n_dense, device="cpu"):
    d = torch.full((J,), groups[0][0], dtype=torch.int32)
    d[:n_dense] = J
    return d.to(device)


@pytest.fixture
def one_tile_chunks(monkeypatch):
    """Score chunks of a single 64-row tile, so a call streams several chunks."""
    monkeypatch.setattr(pooling, "CHUNK_ELEMENTS", 1)


def recorded_windows(monkeypatch):
    seen = []
    real = routing._score_window

    def spy(*args):
        out = real(*args)
        seen.append(tuple(out.shape))
        return out

    monkeypatch.setattr(routing, "_score_window", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,H,J,D,groups,n_dense", CASES)
def test_torch_stream_equals_the_full_matrix_selection(monkeypatch, one_tile_chunks, B, H, J, D, groups, n_dense,
                                                       dtype):
    q, k = means(B, H, J, D, seed=J, dtype=dtype)
    dense_hi = dense_hi_of(J, groups, n_dense)
    want_idx, want_num = select_blocks(pooled_scores(q, k), dense_hi, groups)
    windows = recorded_windows(monkeypatch)
    idx, num = route_blocks(q, k, dense_hi, groups)
    assert idx.dtype == torch.int16
    assert torch.equal(idx, want_idx)
    assert torch.equal(num, want_num)
    lo = groups[0][0] // 64 * 64
    assert windows == [(B, H, min(64, J - i0), groups[-1][1] - lo) for i0 in range(0, J, 64)]  # never J x J


@pytest.mark.parametrize("B,H,J,D,groups,n_dense", CASES)
def test_scoring_only_the_sparse_rows_selects_the_same(monkeypatch, one_tile_chunks, B, H, J, D, groups, n_dense):
    """The planner passes route_plan's sparse span: rows before it are never scored and stay -1,
    windows still start on a score tile, and the selection is the full one."""
    q, k = means(B, H, J, D, seed=J + 1)
    dense_hi = dense_hi_of(J, groups, n_dense)
    want_idx, want_num = select_blocks(pooled_scores(q, k), dense_hi, groups)
    windows = recorded_windows(monkeypatch)
    idx, num = route_blocks(q, k, dense_hi, groups, sparse_rows=(n_dense, J))
    assert torch.equal(idx, want_idx)
    assert torch.equal(num, want_num)
    assert [w[2] for w in windows] == [min(64, J - i0) for i0 in range(n_dense // 64 * 64, J, 64)]
    for bad in ((-1, J), (5, J + 1), (6, 5)):
        with pytest.raises(ValueError, match="sparse_rows"):
            route_blocks(q, k, dense_hi, groups, sparse_rows=bad)


def test_triton_stream_equals_todays_gpu_selection(monkeypatch, one_tile_chunks, triton_device):
    """The streamed kernels (score windows, windowed select) against the full tf32x3 score matrix
    of today's kernel, selected by the torch reference's stable sort."""
    B, H, J, D, groups, n_dense = 1, 1, 70, 32, [(3, 20, 17), (20, 70, 5)], 60  # sparse rows 60..69
    q, k = means(B, H, J, D, seed=3, device=triton_device)
    dense_hi = dense_hi_of(J, groups, n_dense, triton_device)
    want, _ = select_blocks(pooled_scores_triton(q, k), dense_hi, groups)  # no kernels given: the sort
    got, _ = route_blocks(q, k, dense_hi, groups, kernels=resolve("triton", triton_device, torch.float32, strict=True))
    assert torch.equal(got, want)


def test_score_windows_are_the_full_matrix_tiles(triton_device):
    q, k = means(1, 2, 150, 64, seed=1, device=triton_device)
    full = pooled_scores_triton(q, k)
    assert torch.equal(pooled_scores_triton(q, k, (64, 150), (128, 150)), full[:, :, 64:, 128:])
    with pytest.raises(ValueError, match="multiples of 64"):
        pooled_scores_triton(q, k, (10, 150))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantised_scores_kernel_matches_the_torch_path(fmt, triton_device):
    """int8: exact integer sums in both, so equal bits. fp8 in the interpreter: fp32 sums in another
    order, so equal up to fp32 rounding of sums of at most ~1e3 (1e-4 of scores of order 1). fp8 on
    an sm90 GPU: Triton accumulates fp8 tensor-core products with fewer bits than fp32 there
    (`max_num_imprecise_acc`; about 14 bits kept, DeepSeek-V3 report, section 3.3.2), so the bound is
    2**-10 of the scaled sum of absolute products (a wrong code, scale or tile is off by whole scores)."""
    if fmt == "fp8" and (reason := indexer.fp8_unavailable_reason(triton_device)):
        pytest.skip(reason)
    q, k = means(2, 1, 70, 64, seed=4, device=triton_device)
    m = indexer.quantise_means(q, k, fmt)
    got = quantised_scores_triton(m.q_codes, m.q_scale, m.k_codes, m.k_scale, (0, 70), (64, 70))
    want = quantised_scores_torch(m.q_codes, m.q_scale, m.k_codes, m.k_scale, (0, 70), (64, 70))
    if fmt == "int8":
        assert torch.equal(got, want)
    elif triton_device.type == "cpu":
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    else:
        magnitude = quantised_scores_torch(m.q_codes.float().abs(), m.q_scale, m.k_codes.float().abs(), m.k_scale,
                                           (0, 70), (64, 70))
        assert ((got - want).abs() <= 2 ** -10 * magnitude + 1e-6).all()


@pytest.mark.parametrize("fmt,tol", [("int8", 0.04), ("fp8", 0.2)])
def test_quantised_scores_approximate_the_pooled_scores(fmt, tol):
    """The rotation keeps dot products; one scale per row keeps the largest error a small share of
    the score spread even with an outlier dimension (measured: int8 0.025, fp8 e4m3 with its 3
    mantissa bits 0.13; bounds with about 1.5x margin)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 128, generator=g)
    q[..., 5] += 30.0  # an outlier dimension: the rotation spreads it
    k = torch.randn(1, 2, 40, 128, generator=g)
    exact = pooled_scores(q, k)
    m = indexer.quantise_means(q, k, fmt)
    approx = quantised_scores_torch(m.q_codes, m.q_scale, m.k_codes, m.k_scale, (0, 40), (0, 40))
    assert float((approx - exact).abs().max() / exact.std()) < tol
    h = indexer.hadamard(128)
    torch.testing.assert_close(h @ h, torch.eye(128), rtol=0, atol=1e-6)
    assert torch.equal(h, h.T)
    assert set(torch.unique(h * 128 ** 0.5).round().tolist()) == {-1.0, 1.0}


def test_zero_means_quantise_to_zero_codes():
    codes, scale = indexer.quantise(torch.zeros(3, 32), "int8")
    assert (codes == 0).all()
    assert (scale == 1).all()
    with pytest.raises(ValueError, match="fmt='int4'"):
        indexer.quantise(torch.zeros(3, 32), "int4")


def test_int8_stream_selects_identically_on_both_paths(monkeypatch, one_tile_chunks, triton_device):
    B, H, J, D, groups, n_dense = 1, 1, 70, 32, [(3, 20, 2), (20, 70, 1)], 61
    q, k = means(B, H, J, D, seed=6, device=triton_device)
    dense_hi = dense_hi_of(J, groups, n_dense, triton_device)
    want, _ = route_blocks(q, k, dense_hi, groups, "int8")
    got, _ = route_blocks(q, k, dense_hi, groups, "int8", kernels=resolve("triton", triton_device, torch.float32, strict=True))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="scores='bf16'"):
        route_blocks(q, k, dense_hi, groups, "bf16")


def plan_of(idx, num, dense_hi, block_size=64):
    J = dense_hi.numel()
    g = torch.Generator().manual_seed(J)
    block_len = torch.randint(1, block_size + 1, (J,), generator=g, dtype=torch.int32)
    perm = torch.zeros(1, 1, J * block_size, dtype=torch.int32)
    return BlockSparsePlan(Tiling(block_size, perm, perm, block_len), dense_hi, idx, num)


def test_row_chunked_masks_and_block_reduction_equal_the_whole(monkeypatch):
    B, H, J, D, groups, n_dense = CASES[1]
    q, k = means(B, H, J, D, seed=2)
    dense_hi = dense_hi_of(J, groups, n_dense)
    plan = plan_of(*route_blocks(q, k, dense_hi, groups), dense_hi)
    whole = plan.summary_mask()
    assert torch.equal(torch.cat([plan.summary_mask(slice(i, i + 40)) for i in range(0, J, 40)], 2), whole)
    allowed = plan.allowed_mask()
    assert torch.equal(torch.cat([plan.allowed_mask(slice(i, i + 50)) for i in range(0, J, 50)], 2), allowed)
    key, value, bias = k.double(), torch.randn(B, H, J, 16, dtype=torch.float64), torch.randn(B, H, J).double()
    want = tail.block_reduce(q.double(), key, value, bias, plan.dense_hi, plan.q2k_idx, plan.q2k_num)
    monkeypatch.setattr(pooling, "CHUNK_ELEMENTS", 1)  # one 64-row chunk at a time
    got = tail.block_reduce(q.double(), key, value, bias, plan.dense_hi, plan.q2k_idx, plan.q2k_num)
    for a, b in zip(got, want):  # the same sums; BLAS may order a smaller product's sums differently
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
