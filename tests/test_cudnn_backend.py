"""The cuDNN backend's two halves on the CPU: the key lists it hands cuDNN, and the Triton kernel
finishing from a partial result (interpreter); and the whole attention as the registry loads it (the
Triton helpers handed in) through its custom ops, eager and under torch.compile.

cuDNN itself is replaced by `emulated_cudnn`, a float64 torch model of its documented contract
(per query block, the first q2k_block_nums entries of q2k_block_index are its key blocks, keys
past block_sizes are masked, LSE is natural and -inf for a row with no key). So these tests
check what the backend builds and how it joins the parts; the kernel itself is tested on the GPU
(tests/test_gpu_kernels.py). Tolerances: the key lists and the float64 emulation must give the
reference's exact-key attention to 1e-12 (same float64 sums in another order); the finishing
kernel runs in fp32 in the interpreter: 2e-5 on outputs, 1e-4 on the LSE, as in
tests/test_triton_kernel.py.
"""
import dataclasses
import functools

import pytest
import torch

from triton_interpreter import kernel_imports

with kernel_imports():
    pytest.importorskip("triton")
    from adaptive_sparse_attention.kernels.triton.tiled_pack import pack_qkv
    from adaptive_sparse_attention.kernels.triton.attention import block_sparse_triton

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.kernels import EMPTY_ROW_LSE, block_sparse_reference, pack, registry
from adaptive_sparse_attention.kernels.cudnn import cudnn_attention
from adaptive_sparse_attention.kernels.cudnn.cudnn_attention import (block_sparse_cudnn, exact_attention_cudnn, exact_keys,
                                                                     key_lists, sparse_span)
from adaptive_sparse_attention.kernels.registry import helper
from layouts import awkward_layout, with_empty_rows
from random_blocks import random_block_lengths, random_perms

pytestmark = pytest.mark.usefixtures("interpreter")


def emulated_cudnn(q, k, v, index, num, block_len):
    """cuDNN block-sparse forward's contract in float64: (out, lse) of q [B, h, n * 64, D]."""
    B, H, Lq, D = q.shape
    J, bs = block_len.shape[0], Lq // index.shape[2]
    listed = torch.arange(index.shape[-1]).view(1, 1, 1, -1) < num.unsqueeze(-1)
    blocks = torch.zeros(B, H, index.shape[2], J + 1, dtype=torch.bool)
    blocks.scatter_(3, torch.where(listed, index.long(), J), True)
    valid = (torch.arange(bs).view(1, bs) < block_len.view(J, 1)).reshape(-1)
    mask = blocks[..., :J].repeat_interleave(bs, 2).repeat_interleave(bs, 3) & valid
    s = (q.double() @ k.double().transpose(-1, -2) * D ** -0.5).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1)).masked_fill(~mask, 0.0)
    return (p @ v.double()).to(q.dtype), lse.float()


def exact_emulated(q, k, v, plan):
    """`exact_attention_cudnn` as the cuDNN attention runs it (the Triton helper packs), cuDNN emulated."""
    return exact_attention_cudnn(q, k, v, plan, helper("triton", "tiled_pack"),
                                 functools.partial(exact_keys, forward=emulated_cudnn))


CASES = [  # heads, head dim, tiling, scope, tail, granularity, empty rows
    (2, 32, "cube", "target-video", "reweight", "query", False),
    (1, 64, "cube", "joint-video", "reweight", "block", True),
    (2, 32, "reblock", "joint-video", "mean", "query", True),
    (3, 32, "reblock", "target-video", "none", "query", False),
]


def planned(heads, dim, tiling, scope, tail, gran, empty, seed):
    layout = awkward_layout()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, layout.total, dim, generator=g) for _ in range(3))
    cfg = SparseConfig(tiling=tiling, topk_ratio=0.3, sparse_scope=scope, tail=tail, tail_granularity=gran,
                       block_size=64, kernel="torch")
    plan = build_plan(q, k, v, layout, cfg)
    return q, k, v, (with_empty_rows(plan) if empty else plan)


@pytest.mark.parametrize("case", CASES)
def test_key_lists_give_the_exact_keys_of_the_plan(monkeypatch, case):
    """Head chunks of 2 (so 3 heads make an uneven last chunk), both calls (span and outside)."""
    monkeypatch.setattr(cudnn_attention, "HEADS_PER_CALL", 2)
    q, k, v, plan = planned(*case, seed=len(case[2]) + case[0])
    out, lse = exact_emulated(q.double(), k.double(), v.double(), plan)
    exact = dataclasses.replace(plan, tail=None)
    want, want_lse = block_sparse_reference(q.double(), k.double(), v.double(), exact)
    slots = plan.q_perm >= 0
    real = slots.expand(1, q.shape[1], -1)
    torch.testing.assert_close(out[real], pack(want, plan.q_perm)[real], rtol=0, atol=1e-12)
    none = pack(want_lse.unsqueeze(-1), plan.q_perm).squeeze(-1) == EMPTY_ROW_LSE
    assert bool(none[real].any()) == case[-1]
    assert torch.isneginf(lse[real & none]).all()
    torch.testing.assert_close(lse[real & ~none].double(),
                               pack(want_lse.unsqueeze(-1), plan.q_perm).squeeze(-1)[real & ~none],
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_the_kernel_finishing_a_partial_equals_the_reference(case):
    q, k, v, plan = planned(*case, seed=7 + case[0])
    partial = exact_emulated(q, k, v, plan)
    out, lse = helper("triton", "add_tail")(q, plan, partial)  # what the cuDNN attention runs
    ref, ref_lse = block_sparse_reference(q.double(), k.double(), v.double(), plan)
    assert out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-7, atol=1e-4)


def test_the_attention_the_registry_loads_runs_its_ops_eager_and_compiled(monkeypatch):
    """The `cudnn` row loaded by the registry (Triton's pack and tail handed in, both custom ops) around
    cuDNN's own op, one per head chunk (chunks of 2: 3 heads make an uneven last one): the same bits as
    the functions it composes, and under torch.compile (fullgraph, the ops' fakes) the same again. cuDNN
    is emulated and the call check (CUDA only) is lifted, so it runs on the CPU."""
    monkeypatch.setattr(cudnn_attention, "HEADS_PER_CALL", 2)
    monkeypatch.setattr(cudnn_attention, "_forward", emulated_cudnn)
    monkeypatch.setattr(cudnn_attention, "check_call", lambda q, plan: None)
    q, k, v, plan = planned(3, 32, "cube", "target-video", "reweight", "query", False, seed=17)
    attention = registry.load(registry.FAMILIES["cudnn"].of("attention"))
    assert (attention.tiled_pack, attention.add_tail) == (helper("triton", "tiled_pack"), helper("triton", "add_tail"))
    assert attention.heads_per_call == 8 and attention.check is not None
    monkeypatch.setattr(attention, "heads_per_call", 2)  # the row's own chunking and check, as the module's above
    monkeypatch.setattr(attention, "check", None)
    want, want_lse = block_sparse_cudnn(q, k, v, plan, helper("triton", "tiled_pack"), helper("triton", "add_tail"))
    out, lse = attention.attend_blocks(q, k, v, plan)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    ref, _ = block_sparse_reference(q.double(), k.double(), v.double(), plan)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)
    compiled = torch.compile(lambda a, b, c: attention.attend_blocks(a, b, c, plan), fullgraph=True,
                             backend="aot_eager")
    out, lse = compiled(q, k, v)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_a_nan_partial_row_stays_nan_and_a_bad_partial_is_named():
    q, k, v, plan = planned(1, 32, "cube", "target-video", "reweight", "query", False, seed=3)
    part_out, part_lse = exact_emulated(q, k, v, plan)
    lo = sparse_span(plan)[0] * 64
    part_lse[0, 0, lo] = float("nan")
    out, _ = block_sparse_triton(q, q, q, plan, partial=(part_out, part_lse))
    row = int(plan.q_perm[0, 0, lo])
    assert torch.isnan(out[0, 0, row]).all()
    assert int((~torch.isfinite(out)).any(-1).sum()) == 1
    with pytest.raises(ValueError, match="partial must be"):
        block_sparse_triton(q, q, q, plan, partial=(part_out[:, :, :-1], part_lse))


def test_key_lists_keep_the_dense_prefix_then_the_picks():
    q, k, v, plan = planned(2, 32, "cube", "joint-video", "none", "query", False, seed=5)
    lo, hi = sparse_span(plan)
    R = plan.q2k_idx.shape[-1]
    index, num = key_lists(plan, (lo, hi), (0, 2), lo + R)
    assert index.dtype == num.dtype == torch.int32
    assert index.shape == (1, 2, hi - lo, lo + R)
    assert torch.equal(num, plan.q2k_num[:, :, lo:hi] + lo)
    assert torch.equal(index[..., :lo], torch.arange(lo, dtype=torch.int32).expand(1, 2, hi - lo, lo))
    assert torch.equal(index[..., lo:], plan.q2k_idx[:, :, lo:hi].int())


def test_a_plan_without_groups_is_refused_by_name():
    q, k, v, plan = planned(1, 32, "cube", "target-video", "none", "query", False, seed=1)
    with pytest.raises(ValueError, match="plan.groups is empty"):
        exact_emulated(q, k, v, dataclasses.replace(plan, groups=()))


@pytest.mark.parametrize("per_head,bs", [(True, 64), (False, 64), (True, 16)])
def test_fused_pack_equals_plan_pack_on_strided_views(per_head, bs):
    """q, k, v as views of one [B, S, 3, H, D] buffer (H3's qkv layout), edge blocks, padding; with
    16-row blocks the slot count is no multiple of the kernel's 64 slots per program, and v's head
    dim is strided (a transposed view) to cover any innermost stride."""
    B, H, S, D = 2, 3, 301, 32
    g = torch.Generator().manual_seed(11)
    block_len = random_block_lengths(S, bs, g)
    q_perm = random_perms(S, block_len, B if per_head else 1, H if per_head else 1, bs, g)
    k_perm = random_perms(S, block_len, B if per_head else 1, H if per_head else 1, bs, g)
    buf = torch.randn(B, S, 3, H, D, generator=g).half()
    q, k, v = (buf[:, :, i].transpose(1, 2) for i in range(3))
    if bs == 16:
        assert q_perm.shape[-1] % 64
        v = v.transpose(-1, -2).contiguous().transpose(-1, -2)
        assert v.stride(-1) != 1
    qt, kt, vt = pack_qkv(q, k, v, q_perm, k_perm)
    assert all(t.is_contiguous() for t in (qt, kt, vt))
    for got, x, perm in ((qt, q, q_perm), (kt, k, k_perm), (vt, v, k_perm)):
        assert torch.equal(got, pack(x, perm))
    with pytest.raises(ValueError, match="pack_qkv"):
        pack_qkv(q, k, v, q_perm, k_perm[..., :-1])
