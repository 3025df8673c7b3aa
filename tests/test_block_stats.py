"""Fused planner kernels (CPU interpreter) against the torch planner code run in float64.

The reference is `block_means` / `mean_summaries` / `reweight_summaries` on the same inputs
upcast to float64, so the gap is the kernels' own fp32 arithmetic. Tolerances: sums and
summaries in fp32 over at most 64 rows (values of order 1, each step ~1e-7 relative, exp/log a
few ulp): 1e-5 relative and absolute. Outputs stored in fp16 carry one rounding (half an ulp is
2^-11 ~ 4.9e-4 relative), so 1e-3 relative. The reweight bias is checked against the float64
log-sum-exp and the key as the kernel stored it (the definition), so a key that rounds the other
way at a half-ulp boundary does not fail it.
"""

import pytest
import torch

from random_blocks import h3_views, random_tiling
from triton_interpreter import kernel_imports

with kernel_imports():
    pytest.importorskip("triton")
    from adaptive_sparse_attention.kernels.triton.block_stats import block_sums_triton, block_summaries_triton

from adaptive_sparse_attention import SequenceLayout, SparseConfig
from adaptive_sparse_attention.backend import planner
from adaptive_sparse_attention.backend.pooling import block_means
from adaptive_sparse_attention.backend.tail import mean_summaries, reweight_summaries
from adaptive_sparse_attention.kernels.triton.configs import row_align
from adaptive_sparse_attention.kernels.registry import resolve

FP32_TOL = dict(rtol=1e-5, atol=1e-5)
STORED_TOL = {torch.float32: FP32_TOL, torch.float16: dict(rtol=1e-3, atol=1e-5)}


pytestmark = pytest.mark.usefixtures("interpreter")  # every test here runs in the interpreter


CASES = [  # dim, dtype, per-head permutations, block size
    (32, torch.float32, True, 64),
    (64, torch.float16, False, 64),
    (128, torch.float32, False, 64),
    (128, torch.float16, True, 64),
    (48, torch.float32, True, 128),  # head dim and block size padded to powers of two inside
]


@pytest.mark.parametrize("dim,dtype,per_head,block_size", CASES)
def test_block_sums(dim, dtype, per_head, block_size):
    B, H, S = 2, 3, 333
    tiling = random_tiling(S, B if per_head else 1, H if per_head else 1, block_size, seed=dim)
    x, _ = h3_views(B, H, S, dim, dtype, seed=dim + 1)
    sums = block_sums_triton(x, tiling.q_perm, tiling.block_len, block_size)
    ref = block_means(x.double(), tiling.q_perm, tiling) * tiling.block_len.double().view(1, 1, -1, 1)
    assert sums.dtype == torch.float32
    assert sums.shape == (B, H, tiling.num_blocks, dim)
    torch.testing.assert_close(sums.double(), ref, **FP32_TOL)


@pytest.mark.parametrize("dim,dtype,per_head,block_size", CASES)
def test_reweight_summaries(dim, dtype, per_head, block_size):
    B, H, S = 2, 3, 301
    tiling = random_tiling(S, B if per_head else 1, H if per_head else 1, block_size, seed=dim + 7)
    k, v = h3_views(B, H, S, dim, dtype, seed=dim + 8)
    g = torch.Generator().manual_seed(dim + 9)
    anchor = 3 * torch.randn(B, H, dim, generator=g)  # logits of spread ~3: peaked, non-trivial weights
    key, value, bias = block_summaries_triton(k, v, tiling.k_perm, tiling.block_len, block_size, anchor)
    ref_key, ref_value, ref_bias = reweight_summaries(k.double(), v.double(), tiling, anchor.double())
    assert (key.dtype, value.dtype, bias.dtype) == (dtype, dtype, torch.float32)
    assert key.shape == value.shape == (B, H, tiling.num_blocks, dim)
    assert bias.shape == key.shape[:3]
    torch.testing.assert_close(key.double(), ref_key, **STORED_TOL[dtype])
    torch.testing.assert_close(value.double(), ref_value, **STORED_TOL[dtype])
    a = anchor.double().unsqueeze(2)
    scale = dim ** -0.5
    ref_lse = ref_bias + (ref_key * a).sum(-1) * scale  # reference key unrounded in float64
    torch.testing.assert_close(bias.double(), ref_lse - (key.double() * a).sum(-1) * scale, **FP32_TOL)


@pytest.mark.parametrize("dim,dtype,per_head,block_size", CASES[:4])
def test_mean_summaries(dim, dtype, per_head, block_size):
    B, H, S = 2, 2, 290
    tiling = random_tiling(S, B if per_head else 1, H if per_head else 1, block_size, seed=dim + 3)
    k, v = h3_views(B, H, S, dim, dtype, seed=dim + 4)
    key, value, bias = block_summaries_triton(k, v, tiling.k_perm, tiling.block_len, block_size, None)
    k64, v64 = k.double(), v.double()
    ref = mean_summaries(k64, v64, tiling)
    assert (key.dtype, value.dtype, bias.dtype) == (dtype, dtype, torch.float32)
    torch.testing.assert_close(key.double(), ref[0], **STORED_TOL[dtype])
    torch.testing.assert_close(value.double(), ref[1], **STORED_TOL[dtype])
    torch.testing.assert_close(bias.double(), ref[2], rtol=1e-6, atol=0)


@pytest.mark.parametrize("tail_kind", ["reweight", "mean", "coarse"])
def test_build_plan_on_both_backends(tail_kind):
    """The one table: build_plan on the Triton backend (CPU tensors run under the
    interpreter) selects the same blocks and gives the same summaries as on the torch backend,
    and `auto` picks torch for CPU tensors."""
    from adaptive_sparse_attention.backend.tail import coarse_branch
    from adaptive_sparse_attention.kernels.registry import resolve_family

    assert resolve_family("auto", torch.device("cpu"), torch.float32) == "torch"
    layout = SequenceLayout.from_segments([(0, 37, "text"), (37, 127, "ref_video", (3, 5, 6)),
                                           (127, 180, "audio"), (180, 390, "video", (5, 6, 7))])
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, 2, layout.total, 64, generator=g) for _ in range(3))
    cfg = SparseConfig(tiling="cube", topk_ratio=0.3, tail=tail_kind)
    ref = planner.build_plan(q, k, v, layout, cfg, kernels=resolve("torch", q.device, q.dtype))
    got = planner.build_plan(q, k, v, layout, cfg, kernels=resolve("triton", q.device, q.dtype, strict=True))
    assert torch.equal(got.q2k_idx, ref.q2k_idx)
    assert (got.tail is None) == (ref.tail is None) == (tail_kind == "coarse")
    for name in ("key", "value", "bias") if got.tail is not None else ():
        torch.testing.assert_close(getattr(got.tail, name), getattr(ref.tail, name), **FP32_TOL)
    if tail_kind == "coarse":
        for gran in ("query", "block"):
            torch.testing.assert_close(coarse_branch(q, k, v, got, gran, resolve("triton", q.device, q.dtype, strict=True)),
                                       coarse_branch(q, k, v, ref, gran), **FP32_TOL)


def test_row_alignment_divides_the_strides_and_does_not_change_with_the_clip_length():
    """The gather kernels are told that their row offsets are multiples of `row_align` (their batch,
    head and row strides are not all specialised): it must divide every stride that is used, capped
    at one 16-byte vector, and stay the same when only the clip length changes (no new binary),
    for [B, H, S, D] inputs and the [heads, rows, D] views and strided samples the reblock features
    and the head choice read."""
    for seq_len in (301, 302):
        k, v = h3_views(1, 3, seq_len, 48, torch.float16, seed=0)  # batch stride unused at B = 1
        assert row_align(k, v) == 8
        assert row_align(torch.zeros(2, 3, seq_len, 48)) == 4  # fp32: 4 per vector
        assert row_align(torch.zeros(2, 3, seq_len, 50, dtype=torch.float16)[..., :48]) == 2
        assert row_align(torch.zeros(2, 3, seq_len, 5, dtype=torch.bfloat16)) == 1
        assert row_align(k, torch.zeros(2, 3, seq_len, 36, dtype=torch.float16)) == 4  # the least aligned decides
        heads = k[0]  # [G, S, D] view of the qkv buffer (block log-masses, features)
        step = -(-seq_len // 100)  # a strided sample, as `reblock.metric_features` takes (the step follows the length)
        assert row_align(heads) == row_align(heads[:, ::step]) == 8
        assert row_align(torch.zeros(3, seq_len, 40, dtype=torch.bfloat16)[:, ::step]) == 8


def test_bad_inputs_name_the_field():
    tiling = random_tiling(100, 1, 1, 64, seed=0)
    k, v = h3_views(1, 2, 100, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match="dtype=torch.float64"):
        block_sums_triton(k.double(), tiling.k_perm, tiling.block_len, 64)
    with pytest.raises(ValueError, match="perm must be int32"):
        block_sums_triton(k, tiling.k_perm.long(), tiling.block_len, 64)
    with pytest.raises(ValueError, match="anchor must be"):
        block_summaries_triton(k, v, tiling.k_perm, tiling.block_len, 64, torch.zeros(1, 2, 16))
