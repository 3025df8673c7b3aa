"""The 8-bit exact loop (CPU interpreter) against the torch reference of the same quantisation.

What must agree, and how closely:
- The pre-pass's codes and scales (`block_quantise`) equal `eight_bit.quantise_blocks_torch`'s bit
  for bit: both do the same fp32 operations in the same order (one IEEE division, a multiply, a
  half-away-from-zero rounding). Only q . key mean is a sum, in another order: 1e-5 relative.
- FP8: the interpreter converts fp32 to fp8 by its own rule (ties up, subnormals truncated), which is
  not the GPU's; the kernels round to the e4m3 grid first under the interpreter (`e4m3_grid`), so the
  conversion is exact. `test_e4m3_grid_is_the_gpu_and_torch_rounding` proves the rounding equals
  torch's (round to nearest, ties to even, as the GPU's cvt.rn) on every kind of value.
- The kernel's output against the same-quantisation reference (float64 accumulation, fp32 inputs):
  the integer dots are exact and p' is the same fp32 arithmetic, so what is left is fp32 rounding of
  the softmax statistics and of the accumulation: 2e-5 absolute on outputs of size <= ~3, 1e-4 on
  the LSE (as tests/test_triton_kernel.py's fp32 bounds).
- Against the exact float64 reference: rel L2 below 0.06 on Gaussian inputs (measured 0.006-0.036:
  e4m3 keeps 3 mantissa bits, so every V and P code is off by up to 2^-4 relative; on diffuse
  Gaussian attention that is a few percent of the output; docs/performance-notes.md has the scenes).
"""
import dataclasses

import pytest
import torch

from layouts import awkward_layout
from random_blocks import random_block_lengths
from test_triton_kernel import REGION_LENGTHS, random_plan, region_block_lengths
from triton_interpreter import kernel_imports

with kernel_imports():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from adaptive_sparse_attention.kernels.triton.block_quantise import e4m3_grid, quantise_blocks_triton
    from adaptive_sparse_attention.kernels.triton.attention import block_sparse_triton

    @triton.jit
    def _to_e4m3(X, Y, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < N, other=0.0)
        tl.store(Y + offs, e4m3_grid(x).to(tl.float8e4nv), mask=offs < N)

from adaptive_sparse_attention import SparseConfig, sparse_attention
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.kernels import block_sparse_reference
from adaptive_sparse_attention.kernels.arch import EIGHT_BIT_CONFIGS, eight_bit_config
from adaptive_sparse_attention.kernels.triton.op import TritonAttention
from adaptive_sparse_attention.kernels.eight_bit import key_mean, value_max
from adaptive_sparse_attention.kernels.reference.quantise import hadamard_rows, quantise_blocks_torch
from adaptive_sparse_attention.kernels.cudnn.family import CUDNN, MODULE
from adaptive_sparse_attention.kernels.registry import choose_family
from adaptive_sparse_attention.kernels.vocabulary import Host, Target

pytestmark = pytest.mark.usefixtures("interpreter")

ATOL, LSE_TOL, REL_L2 = 2e-5, 1e-4, 0.06


def test_e4m3_grid_is_the_gpu_and_torch_rounding():
    """Normals, subnormals, zero, the largest value, and every tie between two neighbours (half-way
    points, where round-to-nearest-even and the interpreter's ties-up differ)."""
    grid = torch.arange(0, 126, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, no NaN
    ties = (grid[:-1] + grid[1:]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat([grid, ties, torch.rand(4000, generator=g) * 448, torch.rand(2000, generator=g) * 2 ** -6,
                   torch.randn(2000, generator=g)])
    x = torch.cat([x, -x])
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    _to_e4m3[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(y.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


def _awkward_plan(batch, heads, dim, bs, gran, seed, shared=False, regions=True):
    seq_len = sum(REGION_LENGTHS)
    plan = random_plan(seq_len, batch, heads, dim, bs, torch.float32, gran, seed=seed, shared=shared,
                       block_len=region_block_lengths(bs) if regions else None)
    plan.dense_hi[1:3] = 0  # query blocks 1 and 2: nothing exact (with no tail, empty rows)
    plan.q2k_num[:, :, 1:3] = 0
    return plan


@pytest.mark.parametrize("pv", ["fp8", "int8"])
@pytest.mark.parametrize("shared", [False, True])
def test_pre_pass_codes_equal_the_torch_quantisation(pv, shared):
    """Heads 1..3 of 4 (a head chunk that is not the first), bf16 inputs with a large key offset
    (the smoothing's case), per-head or shared permutations, edge blocks of every length."""
    g = torch.Generator().manual_seed(7)
    S, B, H, D, bs = 150, 2, 4, 32, 32
    block_len = random_block_lengths(S, bs, g)
    plan = random_plan(S, B, H, D, bs, torch.float32, "none", seed=3, shared=shared, block_len=block_len)
    q, k, v = (torch.randn(B, H, S, D, generator=g).bfloat16() for _ in range(3))
    k = k + 4.0
    ref = quantise_blocks_torch(q, k, v, plan, pv)
    got = quantise_blocks_triton(q, k, v, plan.q_perm, plan.k_perm, key_mean(k), value_max(v), bs, 1, 4, pv)
    for field in dataclasses.fields(ref):
        want, have = getattr(ref, field.name)[:, 1:4], getattr(got, field.name)
        assert want.shape == have.shape, field.name
        assert want.dtype == have.dtype, field.name
        if field.name == "q_shift":
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want,
                               have.view(torch.uint8) if have.dtype == torch.float8_e4m3fn else have), field.name


@pytest.mark.parametrize("pv", ["fp8", "int8"])
def test_quantisation_error_is_half_a_step(pv):
    """Dequantised codes are within half a code step of the rotated Q and smoothed K (INT8: scale / 2)
    and of V (FP8: 2^-4 relative, or half the subnormal step), and padding slots are zero."""
    g = torch.Generator().manual_seed(1)
    S, B, H, D, bs = 97, 1, 2, 32, 32
    plan = random_plan(S, B, H, D, bs, torch.float32, "none", seed=2)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    c = quantise_blocks_torch(q, k, v, plan, pv)
    from adaptive_sparse_attention.kernels.plan import pack

    J = plan.num_blocks
    qt, kt, vt = pack(q, plan.q_perm), pack(k, plan.k_perm) - key_mean(k).unsqueeze(2), pack(v, plan.k_perm)
    kt = torch.where((plan.k_perm >= 0).unsqueeze(-1), kt, 0.0)
    per_slot = lambda s: s.repeat_interleave(bs, 2).unsqueeze(-1)  # noqa: E731
    for x, codes, scale in ((hadamard_rows(qt), c.q_codes, c.q_scale * 32), (hadamard_rows(kt), c.k_codes, c.k_scale)):
        assert ((codes.float() * per_slot(scale) - x).abs() <= per_slot(scale) * 0.5001).all()  # q_scale has 1/D
    v_deq = c.v_codes.float().transpose(-1, -2) * c.v_scale.unsqueeze(2)
    half_step = c.v_scale.unsqueeze(2) * (0.5 if pv == "int8" else 2 ** -10)  # e4m3: subnormal step 2^-9
    bound = torch.maximum(vt.abs() * (0 if pv == "int8" else 2 ** -4), half_step) * 1.0001  # e4m3: 3 mantissa bits
    assert ((v_deq - vt).abs() <= bound).all()
    pad = (plan.q_perm < 0).expand(B, H, -1)
    assert (c.q_codes[pad] == 0).all()
    assert c.q_codes.shape == (B, H, J * bs, D)


@pytest.mark.parametrize("arch,gran,heads,shared,bs,dim,regions", [
    ("sm89", "query", 2, False, 32, 32, True),    # FP8 P.V, query summaries, per-head permutations
    ("sm80", "block", 9, True, 32, 32, True),     # INT8 P.V, block summaries, two head chunks (8 + 1)
    ("sm90", "none", 1, False, 64, 64, False),    # one head, random block lengths, empty rows
    ("sm120", "query", 2, True, 64, 32, False),
    ("sm80", "none", 2, False, 32, 64, False),
])
def test_kernel_matches_the_same_quantisation(arch, gran, heads, shared, bs, dim, regions):
    """Awkward plans (several regions with edge blocks or random block lengths, query blocks with
    nothing exact, batch 2), fp32 inputs with a key offset: the kernel equals the reference of the
    same quantisation up to fp32 rounding (module docstring), and both are within REL_L2 of exact."""
    plan = _awkward_plan(2, heads, dim, bs, gran, seed=heads + bs + dim, shared=shared, regions=regions)
    g = torch.Generator().manual_seed(heads)
    S = sum(REGION_LENGTHS)
    q, k, v = (torch.randn(2, heads, S, dim, generator=g) for _ in range(3))
    k = k + 2.0
    cfg = EIGHT_BIT_CONFIGS[(arch, dim, 64)]
    out, lse = block_sparse_triton(q, k, v, plan, config=cfg, precision="8-bit")
    ref, ref_lse = block_sparse_reference(q.double(), k.double(), v.double(), plan, eight_bit=cfg)
    exact, _ = block_sparse_reference(q.double(), k.double(), v.double(), plan)
    assert out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=ATOL)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-7, atol=LSE_TOL)
    assert 0 < (ref - exact).norm() / exact.norm() < REL_L2


def test_rows_without_picks_are_the_bf16_kernels():
    """Only the picks go 8-bit: query blocks with no pick (context rows, dense rows, empty rows)
    come out bit for bit as the inputs'-precision kernel gives them (read the same way, gathered)."""
    plan = _awkward_plan(1, 2, 32, 32, "query", seed=4)
    plan.q2k_num[:, :, 3:6] = 0
    plan.dense_hi[4] = plan.num_blocks  # a dense row
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, sum(REGION_LENGTHS), 32, generator=g) for _ in range(3))
    eight, _ = block_sparse_triton(q, k, v, plan, config=eight_bit_config(32, 32, q.device), precision="8-bit")
    plain, _ = block_sparse_triton(q, k, v, plan, tiled=False)
    for h in range(2):
        unpicked = (plan.q2k_num[0, h] == 0).nonzero().flatten().tolist()
        assert len(unpicked) >= 5
        rows = torch.cat([plan.q_perm[0, h, j * 32:(j + 1) * 32] for j in unpicked])
        rows = rows[rows >= 0].long()
        assert torch.equal(eight[0, h, rows], plain[0, h, rows])


def test_smoothing_undoes_a_key_offset():
    """A constant added to every key changes no softmax; the smoothing takes it out of the codes and
    q . mean puts it back, so the 8-bit result moves only by fp32 rounding while a large offset
    would otherwise swamp the INT8 scales (without smoothing the error grows with the offset)."""
    plan = _awkward_plan(1, 2, 32, 32, "none", seed=6)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, sum(REGION_LENGTHS), 32, generator=g) for _ in range(3))
    cfg = eight_bit_config(32, 32, q.device)
    base, _ = block_sparse_triton(q, k, v, plan, config=cfg, precision="8-bit")
    shifted, _ = block_sparse_triton(q, k + 30.0, v, plan, config=cfg, precision="8-bit")
    exact, _ = block_sparse_reference(q.double(), k.double(), v.double(), plan)
    err = lambda x: float((x.double() - exact).norm() / exact.norm())  # noqa: E731
    assert err(shifted) < 1.2 * err(base) < REL_L2


@pytest.mark.slow  # the planner, the custom op and torch.compile under the interpreter
def test_public_entry_point_and_custom_op_run_8_bit():
    """`SparseConfig(precision="8-bit")` reaches the kernel through the planner, the table and the custom
    op (torch.compile included); the torch backend runs the same quantised reference."""
    layout = awkward_layout()
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 2, layout.total, 64, generator=g) for _ in range(3))
    cfg = SparseConfig(tiling="cube", topk_ratio=0.3, kernel="triton", strict=True, precision="8-bit")
    out, info = sparse_attention(q, k, v, layout, cfg, return_info=True)
    assert info.kernel == "triton"
    ref = sparse_attention(q, k, v, layout, cfg.replace(kernel="torch"))
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    bf16 = sparse_attention(q, k, v, layout, cfg.replace(precision="auto"))
    assert (out - bf16).abs().max() > 1e-3  # auto is bf16 (the inputs' precision) inside the engine
    plan = build_plan(q, k, v, layout, cfg)
    eager, eager_lse = block_sparse_triton(q, k, v, plan, precision="8-bit")
    compiled = torch.compile(lambda a, b, c: TritonAttention().attend_blocks(a, b, c, plan, precision="8-bit"),
                             fullgraph=True, backend="aot_eager")
    got, got_lse = compiled(q, k, v)
    assert torch.equal(got, eager)
    assert torch.equal(got_lse, eager_lse)


def test_8_bit_is_resolved_away_from_cudnn_and_bad_requests_raise():
    host = Host(frozenset({"triton", MODULE}), interpret=False)
    bf16 = Target("cuda", (9, 0), torch.bfloat16, 128, 64)
    assert choose_family("auto", bf16, host) == "cudnn"
    assert choose_family("auto", dataclasses.replace(bf16, precision="8-bit"), host) == "triton"
    assert any("precision" in r.label for r in CUDNN.of("attention").requires)
    with pytest.raises(RuntimeError, match="precision '8-bit'"):
        choose_family("cudnn", dataclasses.replace(bf16, precision="8-bit"), host, strict=True)
    with pytest.raises(ValueError, match=r"SparseConfig\.precision.*'int4'"):
        SparseConfig(precision="int4")
    plan = _awkward_plan(1, 1, 32, 32, "none", seed=1)
    q = torch.randn(1, 1, sum(REGION_LENGTHS), 32)
    with pytest.raises(ValueError, match="precision='fp4'"):
        block_sparse_triton(q, q, q, plan, precision="fp4")
    with pytest.raises(ValueError, match="block_size=16"):
        block_sparse_triton(q, q, q, _awkward_plan(1, 1, 32, 16, "none", seed=1), precision="8-bit")
    with pytest.raises(ValueError, match="no partial"):
        block_sparse_triton(q, q, q, plan, partial=(q, q[..., 0]), precision="8-bit")
