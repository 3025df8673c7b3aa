"""The compiled kernels on a CUDA GPU: the block-sparse attention kernel and the fused planner kernels.

Attention (bf16 and fp16): the fast path's error against a float64 reference is bounded, as in
FlashAttention's tests, by a multiple of what the same computation costs at the fast path's own
precision. For every case, on the same plan:
- out_fast: the Triton kernel, or the `cudnn` backend (cuDNN-frontend for the exact keys, the
  Triton kernel for the tail) where its package and GPU are there, or the `sm90` one (the Gluon
  Hopper kernel for the exact keys) on Hopper;
- out_ref64: `block_sparse_reference` on the inputs upcast to float64;
- out_ref_low: the reference at the kernel's precision. `block_sparse_reference` computes 16-bit
  inputs entirely in fp32, which is more accurate than the kernel, so `low_precision_reference`
  emulates the kernel: fp32 scores from the 16-bit inputs (and 16-bit query summaries), one
  softmax in fp32 whose row sum uses the unrounded probabilities, probabilities rounded to the
  input dtype before the products with V and with the summary values (the kernel's `p.to(DOT_DTYPE)`),
  the block summary's probability and value kept in fp32 (as the kernel keeps them), the output
  rounded to the input dtype and the LSE in fp32. The kernel rounds each tile's probabilities
  against its running row maximum rather than the final one: the same relative rounding.
  The emulation run in float64 without rounding must equal the reference (1e-12), so its masks
  and summary columns are the reference's.
Bound: max|out_fast - out_ref64| <= m * max|out_ref_low - out_ref64| + floor, m = 2 for Triton and 3
for cudnn and sm90 (their exact rows are stored in 16 bits before the tail joins), and the same for
the LSE (over rows that may attend to something; rows that may not must be exactly zero with
LSE EMPTY_ROW_LSE in fp32). floor = 4 fp32 roundings of the largest reference value,
4 * eps32 * max|ref64|: the kernel folds the scale into base-2 exponentials and converts its
LSE back (log2, times ln 2), and rescales its fp32 accumulator once per key tile, roundings the
one-pass natural-log reference does not make. It is ~1e-6 on outputs of order 1 (bf16 rounding
alone is ~4e-3) and matters only for the fp32 LSE.

Planner kernels, against the torch code on the same device in float64 (tests/test_block_stats.py,
tests/test_streaming_routing.py): block means and tail summaries to fp32 accuracy (sums of at
most 128 rows: 1e-5 relative and absolute; a summary stored in fp16 / bf16 carries one rounding,
half an ulp is 2^-11 / 2^-9 relative, bounded at 1e-3 / 4e-3). Routing selections are integer
sets and are exact: the streamed `route_blocks` must equal the stable-sort TopK of the full score
matrix of the same kernel (the same tiles, so the same bits), its fp32 scores must be within 1e-5
of the float64 product, and its picks optimal for the float64 scores up to twice that. int8 scores
are exact integer sums on both paths, so the Triton window equals the torch one bit for bit.

Runs alone or in the whole suite: where CUDA is available no test module imports the kernels in
Triton's interpreter mode (tests/triton_interpreter.py; conftest.py fails a test that does).
"""
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("the compiled kernels need a CUDA GPU", allow_module_level=True)
triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: these tests are of the compiled kernels", allow_module_level=True)

from adaptive_sparse_attention import SparseConfig, sparse_attention  # noqa: E402
from adaptive_sparse_attention.backend import indexer, pooling, routing  # noqa: E402
from adaptive_sparse_attention.backend.pooling import block_means  # noqa: E402
from adaptive_sparse_attention.backend.tail import mean_summaries, reweight_summaries  # noqa: E402
from adaptive_sparse_attention.kernels.reference.planner_reference import quantised_scores_torch, topk_blocks  # noqa: E402
from adaptive_sparse_attention.kernels.registry import resolve  # noqa: E402
from adaptive_sparse_attention.kernels import (EMPTY_ROW_LSE, BlockSummaries, QuerySummaries, block_sparse_reference,  # noqa: E402
                                             pack, unpack)
from adaptive_sparse_attention.kernels.triton import block_scores  # noqa: E402
from layouts import awkward_layout, with_empty_rows  # noqa: E402
from random_blocks import h3_views, random_tiling  # noqa: E402

DEVICE = torch.device("cuda")
EPS32 = torch.finfo(torch.float32).eps
FLOOR_ROUNDINGS = 4
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
STORED_TOL = {torch.float32: FP32_TOL, torch.float16: dict(rtol=1e-3, atol=1e-5),
              torch.bfloat16: dict(rtol=4e-3, atol=1e-5)}
SCORE_TOL = 1e-5  # fp32 accuracy of the tf32x3 routing scores of order 1


def kernel_plan(info):
    """The kernel's plan of a `sparse_attention(..., return_info=True)` call."""
    return info.plan


def low_precision_reference(q, k, v, plan, dtype):
    """`block_sparse_reference` at the kernel's precision for 16-bit `dtype` (module docstring), or
    without any rounding in float64 for dtype None. Returns (out, lse) in model order."""
    B, H, S, D = q.shape
    acc = torch.float64 if dtype is None else torch.float32

    def rnd(x):
        return x if dtype is None else x.to(dtype).to(acc)

    bs, J = plan.block_size, plan.num_blocks
    qt, kt, vt = (pack(x, perm).to(acc) for x, perm in ((q, plan.q_perm), (k, plan.k_perm), (v, plan.k_perm)))
    key_valid = (torch.arange(bs, device=q.device).view(1, bs) < plan.block_len.view(J, 1)).reshape(-1)
    mask = plan.allowed_mask().repeat_interleave(bs, 2).repeat_interleave(bs, 3) & key_valid
    cols = [(qt @ kt.transpose(-1, -2) * D ** -0.5).masked_fill(~mask, float("-inf"))]
    vals = [vt]
    tail = plan.tail
    if isinstance(tail, QuerySummaries):
        t = qt @ tail.key.to(acc).transpose(-1, -2) * D ** -0.5 + tail.bias.to(acc).unsqueeze(2)
        cols.append(t.masked_fill(~plan.summary_mask().repeat_interleave(bs, 2), float("-inf")))
        vals.append(tail.value.to(acc))
    if isinstance(tail, BlockSummaries):
        cols.append(tail.logit.to(acc).repeat_interleave(bs, 2).unsqueeze(-1))
        vals.append(None)
    scores = torch.cat(cols, -1)
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    l = p.sum(-1, keepdim=True)
    num = torch.zeros_like(qt)
    col = 0
    for c, val in zip(cols, vals):
        pc = p[..., col:col + c.shape[-1]]
        if val is None:  # the block summary: fp32 probability and value in the kernel
            num = num + pc * tail.value.to(acc).repeat_interleave(bs, 2)
        else:
            num = num + rnd(pc) @ val
        col += c.shape[-1]
    empty = l == 0
    safe = torch.where(empty, torch.ones_like(l), l)
    out = torch.where(empty, torch.zeros_like(num), num / safe)
    lse = torch.where(empty, torch.full_like(l, EMPTY_ROW_LSE), m + torch.log(safe))
    out = unpack(out, plan.q_perm, S)
    return (out if dtype is None else out.to(dtype)), unpack(lse, plan.q_perm, S).squeeze(-1)


ATTENTION_CASES = [  # dtype, batch, heads, head_dim, block size, tiling, scope, tail, granularity, empty rows
    (torch.bfloat16, 2, 2, 128, 64, "cube", "joint-video", "reweight", "query", False),
    (torch.float16, 1, 2, 128, 64, "cube", "joint-video", "reweight", "query", True),
    (torch.bfloat16, 1, 1, 64, 128, "cube", "target-video", "none", "query", True),
    (torch.float16, 1, 1, 64, 64, "reblock", "target-video", "none", "query", False),
    (torch.bfloat16, 1, 2, 64, 64, "reblock", "joint-video", "reweight", "block", True),
    (torch.float16, 2, 2, 128, 128, "reblock", "joint-video", "reweight", "block", False),
    (torch.bfloat16, 1, 2, 128, 128, "reblock", "target-video", "reweight", "query", False),
    (torch.float16, 1, 1, 128, 128, "cube", "joint-video", "reweight", "block", True),
    (torch.bfloat16, 1, 1, 128, 64, "cube", "target-video", "reweight", "block", False),
    (torch.float16, 1, 2, 64, 128, "reblock", "joint-video", "none", "query", True),
    (torch.bfloat16, 1, 2, 64, 128, "cube", "joint-video", "reweight", "query", True),
    (torch.float16, 1, 1, 64, 64, "cube", "target-video", "reweight", "query", False),
]


def case_id(case) -> str:
    dtype, B, H, D, bs, tiling, scope, tail, gran, empty = case
    name = f"{str(dtype)[6:]}-B{B}H{H}-D{D}-bs{bs}-{tiling}-{scope}-{tail}"
    return name + (f"-{gran}" if tail != "none" else "") + ("-empty" if empty else "")


CUDNN_MULTIPLE = 3  # cuDNN stores the exact keys' rows in 16 bits before the tail joins: one rounding more
PACKED_MULTIPLE = CUDNN_MULTIPLE  # the sm90 kernel stores its exact keys' rows in 16 bits too
BACKEND_CASES = [("triton", 2, c) for c in ATTENTION_CASES] + [
    (b, PACKED_MULTIPLE, c) for b in ("cudnn", "sm90") for c in ATTENTION_CASES if c[4] == 64]


@pytest.mark.parametrize("backend,multiple,case", BACKEND_CASES,
                         ids=[f"{b}-{case_id(c)}" for b, _, c in BACKEND_CASES])
def test_attention_kernel_error_is_within_a_multiple_of_the_low_precision_reference(backend, multiple, case):
    """The Triton kernel within 2x; the `cudnn` backend (exact keys on cuDNN-frontend, tail on
    Triton) and the `sm90` one (exact keys on the Hopper kernel, tail on Triton) within 3x, on the same
    plans. All repeat bit for bit."""
    from adaptive_sparse_attention.kernels.registry import unavailable_reason

    dtype, B, H, D, bs, tiling, scope, tail, gran, empty = case
    reason = unavailable_reason(backend, DEVICE, dtype, D, bs) if backend != "triton" else None
    if reason is not None:
        pytest.skip(reason)
    layout = awkward_layout(large=True)
    g = torch.Generator(device=DEVICE).manual_seed(D + bs + H)
    q, k, v = (torch.randn(B, H, layout.total, D, generator=g, device=DEVICE).to(dtype) for _ in range(3))
    cfg = SparseConfig(topk_ratio=0.25, tiling=tiling, sparse_scope=scope, tail=tail, tail_granularity=gran,
                       block_size=bs, kernel=backend, strict=True)
    out_api, info = sparse_attention(q, k, v, layout, cfg, return_info=True)
    plan = kernel_plan(info)
    assert info.kernel == backend
    assert plan.block_size == bs
    assert plan.summary_mask().any()  # candidates left out
    if empty:
        plan = with_empty_rows(plan, empty_tail=True)
    attention = resolve(backend, DEVICE, dtype, strict=True, head_dim=D, block_size=bs).attention
    out_fast, lse_fast = attention.attend_blocks(q, k, v, plan)
    again, lse_again = attention.attend_blocks(q, k, v, plan)
    assert torch.equal(out_fast, again)
    assert torch.equal(lse_fast, lse_again)
    if not empty:
        assert torch.equal(out_fast, out_api)  # the public call runs this kernel on this plan
    q64, k64, v64 = q.double(), k.double(), v.double()
    out64, lse64 = block_sparse_reference(q64, k64, v64, plan)
    emu64, emu_lse64 = low_precision_reference(q64, k64, v64, plan, None)
    torch.testing.assert_close(emu64, out64, rtol=0, atol=1e-12)
    torch.testing.assert_close(emu_lse64, lse64, rtol=0, atol=1e-12)
    out_low, lse_low = low_precision_reference(q, k, v, plan, dtype)

    assert out_fast.dtype == dtype
    assert lse_fast.dtype == torch.float32
    assert torch.isfinite(out_fast).all()
    assert torch.isfinite(lse_fast).all()
    none = lse64 == EMPTY_ROW_LSE
    assert bool(none.any()) == empty
    assert (out_fast[none.unsqueeze(-1).expand_as(out_fast)] == 0).all()
    assert (lse_fast[none] == torch.tensor(EMPTY_ROW_LSE, dtype=torch.float32)).all()
    some = ~none
    pairs = (("out", out_fast, out_low, out64), ("lse", lse_fast[some], lse_low[some], lse64[some]))
    for name, fast, low, ref in pairs:
        err_fast = float((fast.double() - ref).abs().max())
        err_low = float((low.double() - ref).abs().max())
        floor = FLOOR_ROUNDINGS * EPS32 * float(ref.abs().max())
        print(f"{backend} {case_id(case)} {name}: fast {err_fast:.3e} low {err_low:.3e} "
              f"ratio {err_fast / err_low:.3f} floor {floor:.1e}")
        assert err_fast <= multiple * err_low + floor, \
            f"{name}: {err_fast:.3e} > {multiple} * {err_low:.3e} + {floor:.1e}"


PLANNER_CASES = [  # dtype, head dim, block size, per-head permutations
    (torch.bfloat16, 128, 64, True),
    (torch.float16, 64, 128, False),
    (torch.float32, 128, 128, True),
    (torch.bfloat16, 48, 64, False),  # head dim padded to a power of two inside
]


@pytest.mark.parametrize("dtype,dim,block_size,per_head", PLANNER_CASES)
def test_block_means_kernel_matches_float64_torch(dtype, dim, block_size, per_head):
    B, H, S = 2, 3, 1001
    tiling = random_tiling(S, B if per_head else 1, H if per_head else 1, block_size, seed=dim + block_size, device=DEVICE)
    x, _ = h3_views(B, H, S, dim, dtype, seed=dim, device=DEVICE)
    got = block_means(x, tiling.q_perm, tiling, resolve("triton", DEVICE, torch.float32, strict=True))
    want = block_means(x.double(), tiling.q_perm, tiling)  # float64: the torch path
    assert got.dtype == torch.float32
    assert got.shape == (B, H, tiling.num_blocks, dim)
    torch.testing.assert_close(got.double(), want, **FP32_TOL)


@pytest.mark.parametrize("tail", ["reweight", "mean"])
@pytest.mark.parametrize("dtype,dim,block_size,per_head", PLANNER_CASES)
def test_tail_summary_kernel_matches_float64_torch(tail, dtype, dim, block_size, per_head):
    B, H, S = 2, 3, 901
    tiling = random_tiling(S, B if per_head else 1, H if per_head else 1, block_size, seed=dim + 7, device=DEVICE)
    k, v = h3_views(B, H, S, dim, dtype, seed=dim + 8, device=DEVICE)
    k64, v64 = k.double(), v.double()
    if tail == "reweight":
        g = torch.Generator(device=DEVICE).manual_seed(dim + 9)
        anchor = 3 * torch.randn(B, H, dim, generator=g, device=DEVICE)  # peaked, non-trivial weights
        key, value, bias = reweight_summaries(k, v, tiling, anchor, resolve("triton", DEVICE, torch.float32, strict=True))
        ref_key, ref_value, ref_bias = reweight_summaries(k64, v64, tiling, anchor.double())
    else:
        key, value, bias = mean_summaries(k, v, tiling, resolve("triton", DEVICE, torch.float32, strict=True))
        ref_key, ref_value, ref_bias = mean_summaries(k64, v64, tiling)
    assert (key.dtype, value.dtype, bias.dtype) == (dtype, dtype, torch.float32)
    torch.testing.assert_close(key.double(), ref_key, **STORED_TOL[dtype])
    torch.testing.assert_close(value.double(), ref_value, **STORED_TOL[dtype])
    if tail == "reweight":  # the bias is defined against the key as stored
        a = anchor.double().unsqueeze(2)
        scale = dim ** -0.5
        ref_lse = ref_bias + (ref_key * a).sum(-1) * scale
        torch.testing.assert_close(bias.double(), ref_lse - (key.double() * a).sum(-1) * scale, **FP32_TOL)
    else:
        torch.testing.assert_close(bias.double(), ref_bias, rtol=1e-6, atol=0)


ROUTING_CASES = [  # B, H, J, D, groups (lo, hi, budget), leading dense query blocks
    (1, 2, 150, 64, [(5, 70, 1), (70, 150, 80)], 5),  # R = 1 and R = J_r
    (2, 1, 131, 32, [(3, 20, 4), (20, 131, 12)], 20),  # the first chunk's rows partly dense
    (1, 1, 150, 128, [(70, 150, 8)], 0),  # sparse rows before the first candidate tile
]


def tied_means(B, H, J, D, seed):
    """fp32 block means with exact ties: every third key mean repeats an earlier one, some are zero."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(B, H, J, D, generator=g, device=DEVICE)
    k = torch.randn(B, H, J, D, generator=g, device=DEVICE)
    k[:, :, 2::3] = k[:, :, 1::3][:, :, : k[:, :, 2::3].shape[2]]
    k[:, :, 7::11] = 0
    return q, k


def stable_sort_selection(scores, dense_hi, groups):
    """Per group the `budget` highest scores, ties toward the lower index (stable sort), ascending;
    -1 rows for dense query blocks."""
    J = scores.shape[2]
    picks = [topk_blocks(scores[..., lo:hi], budget) + lo for lo, hi, budget in groups]
    idx = torch.cat(picks, -1).sort(-1).values.to(torch.int32)
    return torch.where((dense_hi < J).view(1, 1, J, 1), idx, torch.full_like(idx, -1))


@pytest.mark.parametrize("scores", ["fp32", "int8"])
@pytest.mark.parametrize("B,H,J,D,groups,n_dense", ROUTING_CASES)
def test_route_blocks_kernels_select_exactly(monkeypatch, scores, B, H, J, D, groups, n_dense):
    monkeypatch.setattr(pooling, "CHUNK_ELEMENTS", 1)  # one 64-row tile per chunk: several chunks per call
    q, k = tied_means(B, H, J, D, seed=J + D)
    dense_hi = torch.full((J,), groups[0][0], dtype=torch.int32, device=DEVICE)
    dense_hi[:n_dense] = J
    idx, num = routing.route_blocks(q, k, dense_hi, groups, scores, resolve("triton", DEVICE, torch.float32, strict=True))
    if scores == "fp32":
        full = routing.pooled_scores(q, k, kernels=resolve("triton", DEVICE, torch.float32, strict=True))  # the full matrix of the same tile kernel
        exact = q.double() @ k.double().transpose(-1, -2) * D ** -0.5
        torch.testing.assert_close(full.double(), exact, rtol=0, atol=SCORE_TOL)
    else:
        m = indexer.quantise_means(q, k, "int8")
        full = quantised_scores_torch(m.q_codes, m.q_scale, m.k_codes, m.k_scale, (0, J), (0, J))  # torch: integer sums in fp32
        window = block_scores.quantised_scores_triton(m.q_codes, m.q_scale, m.k_codes, m.k_scale, (0, J), (64, J))
        assert torch.equal(window, full[:, :, :, 64:])
    want = stable_sort_selection(full, dense_hi, groups)
    R = sum(budget for _, _, budget in groups)
    assert idx.shape == (B, H, J, R)
    assert torch.equal(idx.to(torch.int32), want)
    assert torch.equal(num, ((dense_hi < J).to(torch.int32) * R).view(1, 1, J).expand(B, H, J))
    if scores == "fp32":  # optimal for the float64 scores up to the fp32 error of two scores
        rows = dense_hi < J
        for lo, hi, budget in groups:
            part = exact[:, :, rows, lo:hi]
            cols = torch.arange(lo, hi, device=DEVICE)
            chosen = (idx[:, :, rows].long().unsqueeze(-1) == cols).any(-2)
            assert bool((chosen.sum(-1) == budget).all())
            worst_in = part.masked_fill(~chosen, float("inf")).amin(-1)
            best_out = part.masked_fill(chosen, float("-inf")).amax(-1)
            assert bool((worst_in >= best_out - 2 * SCORE_TOL).all())


def test_the_measured_sparse_choice_runs_the_fastest_candidate_within_the_bound(tmp_path):
    """`kernel="auto"` on this GPU: the candidates that run here are measured once per bound; the call returns
    the chosen kernel's own bits, a bf16 bound ranks bf16 kernels only, and the choice is saved."""
    import json

    from adaptive_sparse_attention.kernels.sparse_choice.choice import SparseChoices, named, run

    layout = awkward_layout(large=True)
    g = torch.Generator(device=DEVICE).manual_seed(7)
    q, k, v = (torch.randn(1, 4, layout.total, 128, generator=g, device=DEVICE).to(torch.bfloat16) for _ in range(3))
    choices = SparseChoices(tmp_path / "sparse.json", persist=True)
    measured = 0
    for precision in ("bf16", "8-bit"):
        out, info = sparse_attention(q, k, v, layout, SparseConfig(topk_ratio=0.25, precision=precision),
                                     return_info=True, choices=choices)
        ranking = choices.choices[choices.key(q, info.plan, precision, 0.25)].ranking
        if len(SparseChoices.candidates(q, info.plan, precision)) < 2:
            assert ranking == () and info.kernel in ("triton", "cudnn")
            continue
        measured += 1
        assert ranking and info.kernel == ranking[0]
        assert precision == "8-bit" or all(named(n).precision == "bf16" for n in ranking)
        assert torch.equal(out, run(named(info.kernel), q, k, v, info.plan)[0])
    assert len(json.loads((tmp_path / "sparse.json").read_text())) == measured


@pytest.mark.parametrize("layout_mode", ["q_reuse_k", "independent"])
def test_the_reblock_tilings_cuda_graphs_give_the_eager_bits(layout_mode):
    """The tiling's small-op stages replayed from the layout's CUDA graphs (the metric's factor and basis, the
    partition; captured at the first call, replayed at the second and on new inputs) give the bits of the same
    stages run eagerly (a layout whose cache captures nothing), features and permutations alike."""
    from adaptive_sparse_attention.backend.cache import ShapeCache
    from adaptive_sparse_attention.backend.reblock import reblock_tiling
    from adaptive_sparse_attention.backend.reblock_metric import metric_features

    graphed, eager = awkward_layout(large=True), awkward_layout(large=True)
    eager.cache = ShapeCache(graphs=False)
    triton_kernels = resolve("triton", DEVICE, torch.bfloat16, strict=True)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    for _ in range(3):  # capture, replay, replay on other inputs
        q, k = (torch.randn(1, 3, graphed.total, 64, generator=g, device=DEVICE).to(torch.bfloat16) for _ in range(2))
        seg = graphed.regions()[-1]
        ks, qs = (x[:, :, seg.start:seg.stop].reshape(3, seg.length, 64) for x in (k, q))
        assert torch.equal(metric_features(ks, qs, triton_kernels, graphed.cache), metric_features(ks, qs, triton_kernels))
        a = reblock_tiling(q, k, graphed, 64, layout_mode, kernels=triton_kernels)
        b = reblock_tiling(q, k, eager, 64, layout_mode, kernels=triton_kernels)
        assert torch.equal(a.q_perm, b.q_perm) and torch.equal(a.k_perm, b.k_perm)
    assert graphed.cache.has("metric_graph", ("factor", (3, 64, 64), torch.float64, str(q.device)))
