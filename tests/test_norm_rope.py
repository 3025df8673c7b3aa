"""The QKV producer's Triton epilogue (compiled on a GPU, else the CPU interpreter) against float64 and
the torch reference.

The oracle is the epilogue's maths in float64 (RMSNorm over D, then the rotation of pairs (i, i + r/2)
of the first r dims). Tolerances: the kernel sums squares and scales in fp32 (about 1e-6 relative at
D <= 128), rounds the normed row to the input dtype, the rotation's two products and their sum to the
table's dtype: up to four roundings of half an ulp each, so 2 ulps of the coarser dtype, relative to
the row's largest value (fp32 2.4e-7, fp16 9.8e-4, bf16 7.8e-3). Against the torch reference in fp32 the
gap is the order of the fp32 sums (1e-6). The shapes are awkward on purpose: odd row counts and starts,
one and three heads, a head dim that is no power of two, rot_dim 96 of 128 as H3 has it, no table.
"""

import pytest
import torch

from triton_interpreter import kernel_imports

with kernel_imports():
    pytest.importorskip("triton")
    from adaptive_sparse_attention.kernels.triton.norm_rope import norm_rope_triton

from h3_block import block_args
from h3_harness import PACKED, model_of
from adaptive_sparse_attention.backend import producer
from adaptive_sparse_attention.kernels.reference.norm_rope import norm_rope_torch
from adaptive_sparse_attention.kernels.registry import resolve
from adaptive_sparse_attention.notices import Notices

ULPS = {torch.float32: 2 * 2.0 ** -23, torch.float16: 2 * 2.0 ** -10, torch.bfloat16: 2 * 2.0 ** -7}
CASES = [  # x dtype, table dtype (None: no RoPE), D, rot_dim / 2, heads, rows, start
    (torch.float32, torch.float32, 128, 48, 3, 37, 5),
    (torch.bfloat16, torch.bfloat16, 128, 48, 1, 21, 0),  # H3: bf16 model, bf16 table, rot_dim 96
    (torch.bfloat16, torch.float32, 64, 32, 2, 17, 9),  # the whole head rotated
    (torch.float16, torch.float16, 32, 4, 3, 3, 1),
    (torch.float32, None, 48, 0, 2, 19, 2),  # D not a power of two, no RoPE
]


def inputs(dtype, tdtype, D, half, g, n, seed, device):
    gen = torch.Generator().manual_seed(seed)
    chunk = (3 * torch.randn(n, 3 * g * D, generator=gen)).to(device, dtype)
    angle = 6 * torch.rand(n, half, generator=gen, dtype=torch.float64)
    table = None if tdtype is None else torch.stack(
        [angle.cos(), -angle.sin(), angle.sin(), angle.cos()], -1).reshape(1, n, 1, half, 2, 2).to(device, tdtype)
    scales = [(0.5 + torch.rand(D, generator=gen)).to(device, dtype) for _ in range(2)]
    return chunk, table, scales


def ideal(x: torch.Tensor, table: torch.Tensor | None, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """The epilogue of x [n, g, D] in float64: RMSNorm, then the split-half rotation."""
    x = x.cpu().double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale.cpu().double()
    if table is None:
        return y
    t, half = table[0].cpu().double(), table.shape[-3]
    a, b = y[..., :half], y[..., half:2 * half]
    return torch.cat((t[..., 0, 0] * a + t[..., 0, 1] * b, t[..., 1, 0] * a + t[..., 1, 1] * b, y[..., 2 * half:]), -1)


def run(epilogue, chunk, table, scales, g, D, S, start, dtype):
    q, k, v = (torch.full((1, g, S, D), 7.0, dtype=dtype, device=chunk.device) for _ in range(3))
    epilogue(chunk, q, k, v, start, table, *scales, 1e-6)
    return q, k, v


@pytest.mark.parametrize("dtype,tdtype,D,half,g,n,start", CASES)
def test_epilogue_matches_float64_and_the_reference(triton_device, dtype, tdtype, D, half, g, n, start):
    chunk, table, scales = inputs(dtype, tdtype, D, half, g, n, seed=D + n, device=triton_device)
    S = start + n + 4
    got = run(norm_rope_triton, chunk, table, scales, g, D, S, start, dtype)
    ref = run(norm_rope_torch, chunk, table, scales, g, D, S, start, dtype)
    parts = chunk.view(n, 3, g, D).unbind(1)
    want = [ideal(parts[0], table, scales[0], 1e-6), ideal(parts[1], table, scales[1], 1e-6), parts[2].double()]
    ulp = max(ULPS[dtype], ULPS.get(tdtype, 0.0))
    for out, r, w in zip(got, ref, want):
        rows, w = out[0, :, start:start + n].transpose(0, 1).cpu().double(), w.cpu()
        size = w.abs().amax(-1, keepdim=True)
        assert ((rows - w).abs() <= ulp * size).all(), ((rows - w).abs() / size).max()
        for other in (out[0, :, :start], out[0, :, start + n:]):  # rows outside the chunk untouched
            assert (other == 7.0).all()
        if dtype == torch.float32:
            torch.testing.assert_close(out, r, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2], ref[2])  # v is a copy


def test_producer_with_the_triton_epilogue_matches_the_block(triton_device):
    """produce_qkv with the resolved Triton epilogue gives the block's q, k, v (chunks, head ranges)."""
    block = model_of(True, seed=19).blocks[0].to(triton_device, torch.float32)
    args = block_args(block, PACKED, seed=20, new=True, dtype=torch.float32)
    args = {name: a.to(triton_device) if isinstance(a, torch.Tensor) else a for name, a in args.items()}
    attn = block.attn
    kernels = resolve("triton", triton_device, torch.float32, head_dim=32, strict=True)
    assert kernels.norm_rope.family == "triton"
    with torch.no_grad():
        expected = [t for t in attn.qkv(args["img"], args["rope_freqs"])]
        for chunk, heads in ((7, None), (4096, (1, 3)), (100, (0, 1))):
            got = producer.produce_qkv(args["img"], attn.qkv_proj.weight, None, 3, 32, attn.q_norm.weight,
                                       attn.k_norm.weight, attn.q_norm.eps, args["rope_freqs"], heads, chunk,
                                       norm_rope=kernels.norm_rope)
            h0, h1 = heads or (0, 3)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e[:, h0:h1], rtol=2e-5, atol=2e-5)


def test_inputs_the_kernel_does_not_take_run_the_reference_and_say_so(triton_device, caplog):
    """Inputs that need gradients, or a table whose 2 x 2 matrices are not contiguous, go to the torch
    reference, said once (strict raises)."""
    chunk, table, scales = inputs(torch.float32, torch.float32, 32, 8, 2, 5, seed=3, device=triton_device)
    stage = resolve("triton", triton_device, torch.float32, head_dim=32, notices=Notices()).norm_rope
    strict = resolve("triton", triton_device, torch.float32, head_dim=32, strict=True).norm_rope
    transposed = table.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, strides (..., 1, 2)

    def out():
        return [torch.zeros(1, 2, 5, 32, device=triton_device) for _ in range(3)]

    want = out()
    norm_rope_torch(chunk, *want, 0, table, *scales, 1e-6)
    for case, (c, t), reason in (("grad", (chunk.clone().requires_grad_(True), table), "gradients"),
                                 ("strides", (chunk, transposed), "rotation table with strides")):
        got = out()
        with caplog.at_level("WARNING"):
            stage(c, *got, 0, t, *scales, 1e-6)
        assert "norm_rope: the triton kernel cannot take these inputs" in caplog.text and reason in caplog.text
        assert got[0].requires_grad == (case == "grad")  # the reference kept the graph
        for g, w in zip(got, want):
            torch.testing.assert_close(g.detach(), w)
        caplog.clear()
        with pytest.raises(RuntimeError, match=f"norm_rope: the triton kernel cannot take these inputs.*{reason}"):
            strict(c, *out(), 0, t, *scales, 1e-6)
