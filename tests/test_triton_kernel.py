"""The fused Triton kernel (CPU interpreter) against the pure-torch reference.

The reference runs in float64 on the same (rounded) inputs, so the gap is the kernel's own
arithmetic. Tolerances: fp32 inputs, fp32 dots and accumulation: 2e-5 absolute on outputs of
size <= ~3 (a few hundred fp32 terms per row, ~1e-7 each, with margin). fp16 inputs: the output
is rounded to fp16 (half an ulp is 2^-11 relative, <= 1e-3 for |out| < 2), so 2e-3. LSE is fp32
in both cases: 1e-4. Shapes stay small (a few hundred tokens) because the interpreter takes
milliseconds per program step.
"""
import dataclasses

import pytest
import torch

from layouts import awkward_layout
from random_blocks import random_block_lengths, random_perms
from triton_interpreter import kernel_imports

with kernel_imports():
    pytest.importorskip("triton")
    from adaptive_sparse_attention.kernels.triton import attention as triton_attention
    from adaptive_sparse_attention.kernels.triton.attention import block_sparse_triton

from adaptive_sparse_attention import SparseConfig, sparse_attention
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.kernels import (EMPTY_ROW_LSE, BlockSparsePlan, BlockSummaries, QuerySummaries, Tiling,
                                             block_sparse_reference)
from adaptive_sparse_attention.kernels.arch import ARCH_ENV, KernelConfig, kernel_config
from adaptive_sparse_attention.kernels.triton.op import TritonAttention

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
LSE_TOL = 1e-4


pytestmark = pytest.mark.usefixtures("interpreter")  # every test here runs in the interpreter


def inputs(layout, heads, dim, dtype, seed, batch=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, layout.total, dim, generator=g).to(dtype) for _ in range(3)]


def check(q, k, v, plan, **kwargs):
    out, lse = block_sparse_triton(q, k, v, plan, **kwargs)
    ref, ref_lse = block_sparse_reference(q.double(), k.double(), v.double(), plan)
    assert out.dtype == q.dtype
    assert out.shape == q.shape
    assert lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=TOL[q.dtype])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-7, atol=LSE_TOL)  # rtol: EMPTY_ROW_LSE in fp32
    return out, lse


@pytest.mark.parametrize("dim,dtype,scope,tail,gran,ratio", [
    (32, torch.float32, "joint-video", "reweight", "query", 0.3),
    (64, torch.float16, "target-video", "reweight", "query", 0.2),
    (128, torch.float32, "target-video", "mean", "block", 0.1),
    (128, torch.float16, "joint-video", "reweight", "block", 0.3),
    (64, torch.float32, "joint-video", "none", "query", 0.5),
])
def test_planned_cube_plans(dim, dtype, scope, tail, gran, ratio):
    layout = awkward_layout()
    q, k, v = inputs(layout, 2, dim, dtype, seed=dim)
    cfg = SparseConfig(tiling="cube", topk_ratio=ratio, sparse_scope=scope, tail=tail, tail_granularity=gran)
    check(q, k, v, build_plan(q, k, v, layout, cfg))


def test_block_size_128_whole_or_split_query_blocks_and_batch_shares_plan():
    layout = awkward_layout()
    q, k, v = inputs(layout, 1, 32, torch.float32, seed=3, batch=2)
    cfg = SparseConfig(tiling="cube", topk_ratio=0.25, block_size=128, tail="reweight")
    plan = build_plan(q, k, v, layout, cfg)
    assert plan.block_size == 128
    for arch in ("sm80", "sm90"):  # 64-row tiles (two programs per block) and 128-row tiles
        check(q, k, v, plan, config=kernel_config(32, 128, q.device, arch=arch))


def random_plan(seq_len, batch, heads, dim, block_size, dtype, gran, seed, shared=False, block_len=None):
    """A hand-built plan: blocks of random true length (1..block_size) unless `block_len` is given,
    per-(batch, head) permutations (`shared`: one [1, 1, L] for all), random dense prefixes and sorted
    selections of varying length (including none), random tail summaries."""
    g = torch.Generator().manual_seed(seed)
    block_len = random_block_lengths(seq_len, block_size, g) if block_len is None else block_len
    J = block_len.numel()

    def perms():
        return random_perms(seq_len, block_len, 1 if shared else batch, 1 if shared else heads, block_size, g)

    dense_hi = torch.randint(0, J + 1, (J,), generator=g, dtype=torch.int32)
    dense_hi[: J // 4] = 0
    cols = torch.arange(J)
    mask = (torch.rand(batch, heads, J, J, generator=g) < 0.4) & (cols.view(1, J) >= dense_hi.view(J, 1).long())
    num = mask.sum(-1, dtype=torch.int32)
    idx = torch.sort(torch.where(mask, cols, torch.full_like(cols, J)), -1).values[..., : max(1, int(num.max()))]
    idx = torch.where(idx == J, torch.full_like(idx, -1), idx).to(torch.int32)
    shape = (batch, heads, J)
    tail = None
    if gran == "query":
        tail = QuerySummaries(torch.randn(*shape, dim, generator=g).to(dtype), torch.randn(*shape, dim, generator=g).to(dtype),
                              torch.rand(shape, generator=g) * 4)
    elif gran == "block":
        tail = BlockSummaries(torch.where(torch.rand(shape, generator=g) < 0.2, float("-inf"),
                                          torch.randn(shape, generator=g) * 3), torch.randn(*shape, dim, generator=g))
    return BlockSparsePlan(Tiling(block_size, perms(), perms(), block_len), dense_hi, idx, num, tail=tail)


@pytest.mark.parametrize("gran,dtype,dim", [("query", torch.float32, 64), ("block", torch.float16, 32),
                                            ("none", torch.float16, 128)])
def test_per_head_permutations_and_random_tables(gran, dtype, dim):
    layout = awkward_layout()
    q, k, v = inputs(layout, 2, dim, dtype, seed=11, batch=2)
    plan = random_plan(layout.total, 2, 2, dim, 64, dtype, gran, seed=5)
    assert plan.q_perm.shape[:2] == (2, 2)
    assert (plan.q2k_num == 0).any()
    check(q, k, v, plan)


def test_selected_summaries_are_not_counted_twice():
    """The query tail skips the selected columns by walking the ascending pick list: 16-token
    blocks and 16 summary columns per step give several steps per row, with picks in each and
    across their boundaries; heavy summaries (bias +6) would show any column counted twice."""
    plan = random_plan(awkward_layout().total, 1, 1, 32, 16, torch.float32, "query", seed=9)
    plan = dataclasses.replace(plan, tail=dataclasses.replace(plan.tail, bias=plan.tail.bias + 6.0))
    J = plan.num_blocks
    assert J > 2 * 16
    assert (plan.q2k_num > 16).any()
    q, k, v = inputs(awkward_layout(), 1, 32, torch.float32, seed=8)
    check(q, k, v, plan, config=KernelConfig(16, 16, 16, 4, 1))


REGION_LENGTHS = (37, 45, 29, 50)  # no multiple of 16: every region ends in an edge block


def region_block_lengths(block_size):
    """int32 [J]: every region of REGION_LENGTHS cut into blocks of `block_size` rows, the last one short."""
    lengths = []
    for n in REGION_LENGTHS:
        lengths += [block_size] * (n // block_size) + [n % block_size]
    return torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.slow  # the largest interpreter cases: up to a minute each on 2 cores
@pytest.mark.parametrize("heads,shared,blocks,bs,dim,dtype,gran", [
    (9, False, "regions", 32, 32, torch.float32, "query"),
    (11, True, "regions", 32, 32, torch.float16, "block"),
    (10, True, "random", 32, 32, torch.float16, "none"),
    (2, False, "random", 16, 64, torch.float32, "block"),
    (1, True, "regions", 16, 32, torch.float32, "none"),
    (2, False, "random", 32, 32, torch.float16, "query"),
])
def test_tiled_and_gather_modes_agree_with_the_reference(heads, shared, blocks, bs, dim, dtype, gran):
    """Both ways of reading the exact keys (`tiled`) on awkward plans of 161 rows: several regions
    or random block lengths (edge blocks everywhere; slot counts mostly no multiple of 64),
    per-head or shared permutations, 9 to 11 heads (two head chunks in tiled mode, the second of
    one or three heads, so chunk-local and global heads differ), batch 2, and query blocks 1 and 2
    with no exact key (with no tail their rows attend to nothing). Tolerances against the float64
    reference are `check`'s (module docstring: fp32 arithmetic, fp16 output rounding). The two
    modes feed the same tiles (zeros in the packed padding where the gather masks) to the same
    arithmetic in the same order, so they must agree bit for bit."""
    seq_len = sum(REGION_LENGTHS)
    plan = random_plan(seq_len, 2, heads, dim, bs, dtype, gran, seed=heads + bs, shared=shared,
                       block_len=region_block_lengths(bs) if blocks == "regions" else None)
    plan.dense_hi[1:3] = 0
    plan.q2k_num[:, :, 1:3] = 0
    assert (plan.q_perm.shape[:2] == (1, 1)) == shared
    g = torch.Generator().manual_seed(heads)
    q, k, v = (torch.randn(2, heads, seq_len, dim, generator=g).to(dtype) for _ in range(3))
    ref, ref_lse = block_sparse_reference(q.double(), k.double(), v.double(), plan)
    results = [block_sparse_triton(q, k, v, plan, tiled=tiled) for tiled in (True, False)]
    for out, lse in results:
        assert out.dtype == q.dtype
        assert torch.isfinite(out).all()
        assert torch.isfinite(lse).all()
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=TOL[q.dtype])
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-7, atol=LSE_TOL)
    (tiled_out, tiled_lse), (gather_out, gather_lse) = results
    assert torch.equal(tiled_out, gather_out)
    assert torch.equal(tiled_lse, gather_lse)


def test_empty_rows_give_zeros_and_finite_lse():
    layout = awkward_layout()
    q, k, v = inputs(layout, 2, 32, torch.float32, seed=4)
    plan = random_plan(layout.total, 1, 2, 32, 64, torch.float32, "none", seed=6)
    plan.dense_hi[:3] = 0
    plan.q2k_num[:, :, :3] = 0
    out, lse = check(q, k, v, plan)
    for h in range(2):
        rows = plan.q_perm[0, h, : 3 * 64]
        rows = rows[rows >= 0].long()
        assert (out[0, h, rows] == 0).all()
        assert (lse[0, h, rows] == EMPTY_ROW_LSE).all()


def test_strided_inputs_and_sub_block_tiles():
    """q, k, v as views of a [B, S, H, D] buffer (how H3 produces them); query and key tiles of
    half a block (two programs per query block, two key tiles per block) and summary tiles of 16
    columns exercise the list walk inside and across blocks and the tail loop over several tiles."""
    layout = awkward_layout()
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(1, layout.total, 3, 1, 32, generator=g)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    plan = random_plan(layout.total, 1, 1, 32, 32, torch.float32, "query", seed=8)
    assert plan.num_blocks > 16
    out, _ = check(q, k, v, plan, config=KernelConfig(16, 16, 16, 4, 2))
    assert out.transpose(1, 2).is_contiguous()  # same [B, S, H, D] memory order as the inputs


@pytest.mark.parametrize("wide", [False, True])
def test_narrow_and_wide_row_offsets(monkeypatch, wide):
    """Row offsets are int32 unless a (batch, head) slice can pass 2**31 elements (H3's fused qkv
    buffer at 14 s clips); both variants give the reference result."""
    big = torch.empty_strided((1, 2, 8, 128), (0, 128, 3 * 2 ** 28, 1), device="meta")
    assert triton_attention.wide_rows(big)
    assert not triton_attention.wide_rows(torch.zeros(1, 2, 8, 128))
    monkeypatch.setattr(triton_attention, "wide_rows", lambda *tensors: wide)
    layout = awkward_layout()
    q, k, v = inputs(layout, 2, 32, torch.float32, seed=3, batch=1)
    check(q, k, v, random_plan(layout.total, 1, 2, 32, 64, torch.float32, "query", seed=4))


def test_archs_are_forced_and_validated(monkeypatch):
    cpu = torch.device("cpu")
    assert kernel_config(128, 64, cpu, arch="sm90") != kernel_config(128, 64, cpu, arch="sm80")
    monkeypatch.setenv(ARCH_ENV, "sm90")
    assert kernel_config(128, 64, cpu) == kernel_config(128, 64, cpu, arch="sm90")
    monkeypatch.setenv(ARCH_ENV, "sm70")
    with pytest.raises(ValueError, match="sm70"):
        kernel_config(128, 64, cpu)
    with pytest.raises(ValueError, match="head_dim=96"):
        kernel_config(96, 64, cpu, arch="sm80")


def test_bad_inputs_raise():
    layout = awkward_layout()
    q, k, v = inputs(layout, 1, 32, torch.float64, seed=1)
    plan = random_plan(layout.total, 1, 1, 32, 64, torch.float64, "none", seed=1)
    with pytest.raises(ValueError, match="dtype"):
        block_sparse_triton(q, k, v, plan)
    with pytest.raises(ValueError, match="block_size=48"):
        plan48 = random_plan(layout.total, 1, 1, 32, 48, torch.float32, "none", seed=1)
        block_sparse_triton(q.float(), k.float(), v.float(), plan48)


def test_custom_op_dispatch_and_compile():
    layout = awkward_layout()
    q, k, v = inputs(layout, 1, 32, torch.float32, seed=12)
    plan = build_plan(q, k, v, layout, SparseConfig(tiling="cube", topk_ratio=0.3))
    eager, eager_lse = block_sparse_triton(q, k, v, plan)
    via_op, _ = TritonAttention().attend_blocks(q, k, v, plan)
    assert torch.equal(via_op, eager)
    compiled = torch.compile(lambda a, b, c: TritonAttention().attend_blocks(a, b, c, plan), fullgraph=True,
                             backend="aot_eager")
    out, lse = compiled(q, k, v)
    assert torch.equal(out, eager)
    assert torch.equal(lse, eager_lse)


def test_public_entry_point_with_triton_backend():
    layout = awkward_layout()
    q, k, v = inputs(layout, 2, 64, torch.float32, seed=13)
    cfg = SparseConfig(tiling="cube", topk_ratio=0.2, kernel="triton", strict=True)
    out, info = sparse_attention(q, k, v, layout, cfg, return_info=True)
    ref = sparse_attention(q, k, v, layout, cfg.replace(kernel="torch"))
    assert info.kernel == "triton"
    torch.testing.assert_close(out, ref, rtol=0, atol=TOL[torch.float32])
