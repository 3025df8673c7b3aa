"""Hostile and broken tensors, layouts and arguments to `sparse_attention`.

- Non-finite values (seeded random positions, NaN / +inf / -inf): one in q leaves at most that
  row's query block non-finite; one in k or v loses no more rows than dense attention does
  (which loses the whole (batch, head)), and never touches another batch or head. Every tail,
  tiling and granularity on the torch backend; four cases in the Triton interpreter that take
  each of them at least once; every case on the GPU (fused planner kernels; skipped without CUDA).
- Empty batch or heads, and sequences shorter than one block: the right result on every tiling,
  tail and backend (an empty output; dense attention).
- Wrong kinds of argument: TypeError or ValueError naming the argument and its value, raised
  before any planning, within a second.
"""
from __future__ import annotations

import itertools
import math
import random
import time

import numpy as np
import pytest
import torch

from triton_interpreter import kernel_imports

with kernel_imports():
    pytest.importorskip("triton")
    from adaptive_sparse_attention.kernels.triton.block_stats import block_summaries_triton

from adaptive_sparse_attention import SequenceLayout, SparseConfig, sparse_attention
from adaptive_sparse_attention.backend import attention
from adaptive_sparse_attention.backend.config import TAIL_GRANULARITIES, TAILS, TILINGS
from adaptive_sparse_attention.backend.tail import coarse_branch, mean_summaries, reweight_summaries
from adaptive_sparse_attention.backend.tiling import cube_tiling

LAYOUT = SequenceLayout.from_segments([(0, 24, "text"), (24, 88, "ref_video", (2, 4, 8)),
                                       (88, 344, "video", (4, 8, 8))])
SMALL = SequenceLayout.from_segments([(0, 24, "text"), (24, 88, "ref_video", (2, 4, 8)),
                                      (88, 216, "video", (2, 8, 8))])  # for the interpreter
SHORT = SequenceLayout.from_segments([(0, 5, "text"), (5, 13, "video", (2, 2, 2))])  # shorter than one block
D = 32
BAD_VALUES = (float("nan"), float("inf"), -float("inf"))
COMBOS = list(itertools.product(TAILS, TILINGS, TAIL_GRANULARITIES))


def config(tail: str, tiling: str, granularity: str, backend: str, rng: random.Random) -> SparseConfig:
    return SparseConfig(topk_ratio=0.25, tail=tail, tiling=tiling, tail_granularity=granularity, kernel=backend,
                        sparse_scope=rng.choice(["target-video", "joint-video"]),
                        reblock_layout=rng.choice(["q_reuse_k", "independent"]))


def run(q, k, v, layout, cfg, **kwargs):
    gate = torch.full((q.shape[1], 1, 1), 0.5, dtype=q.dtype, device=q.device) if cfg.tail == "coarse" else None
    return sparse_attention(q, k, v, layout, cfg, coarse_gate=gate, **kwargs)


def poison(seed: int, shape: tuple[int, ...], which: str) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
    """Random q, k, v with one NaN or inf at a random (batch, head, row, dim) of `which`."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(shape, generator=g) for _ in range(3)]
    b, h, row = (rng.randrange(n) for n in shape[:3])
    qkv["qkv".index(which)][b, h, row, rng.randrange(shape[3])] = rng.choice(BAD_VALUES)
    return qkv, (b, h, row)


def bad_rows(out: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(out).all(-1)  # [B, H, S]


def check_locality(q, k, v, which, where, cfg, layout: SequenceLayout = LAYOUT) -> None:
    out, info = run(q, k, v, layout, cfg, return_info=True)
    bad = bad_rows(out)
    b, h, row = where
    if which == "q":  # at most the rows of the poisoned row's query block in its own (batch, head)
        perm = info.plan.tiling.q_perm
        perm = perm[min(b, perm.shape[0] - 1), min(h, perm.shape[1] - 1)]
        bs = info.plan.tiling.block_size
        block = int((perm == row).nonzero()[0]) // bs
        allowed = torch.zeros_like(bad)
        members = perm[block * bs:(block + 1) * bs]
        allowed[b, h, members[members >= 0].long()] = True
        assert bad[b, h, row], "the poisoned row itself must not look finite"
        assert not (bad & ~allowed).any(), f"{int((bad & ~allowed).sum())} rows outside query block {block} are bad"
    else:  # no more rows than dense attention loses, per (batch, head)
        dense = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
        assert (bad.sum(-1) <= bad_rows(dense).sum(-1)).all()


@pytest.mark.parametrize("which", "qkv")
def test_non_finite_inputs_stay_local_on_the_torch_backend(which):
    for i, (tail, tiling, granularity) in enumerate(COMBOS):
        seed = 1000 * "qkv".index(which) + i
        (q, k, v), where = poison(seed, (1, 2, LAYOUT.total, D), which)
        check_locality(q, k, v, which, where, config(tail, tiling, granularity, "torch", random.Random(seed)))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NumPy, on the NaN we put in
def test_non_finite_inputs_stay_local_in_the_triton_interpreter(interpreter):
    """Four cases that take every tail, tiling and granularity at least once (the interpreter is slow)."""
    rng = random.Random(20)
    for i, tail in enumerate(TAILS):
        tiling, granularity = TILINGS[i % 2], TAIL_GRANULARITIES[(i // 2 + i) % 2]
        which = "qkvq"[i]
        (q, k, v), where = poison(2000 + i, (1, 1, SMALL.total, D), which)  # one head: the interpreter is slow
        check_locality(q, k, v, which, where, config(tail, tiling, granularity, "triton", rng), SMALL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused planner kernels and the compiled kernel need CUDA")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_non_finite_inputs_stay_local_on_the_gpu(backend):
    for i, ((tail, tiling, granularity), which) in enumerate(itertools.product(COMBOS, "qkv")):
        (q, k, v), where = poison(3000 + i, (2, 3, LAYOUT.total, D), which)
        q, k, v = (x.cuda() for x in (q, k, v))
        check_locality(q, k, v, which, where, config(tail, tiling, granularity, backend, random.Random(i)))


def test_fused_summaries_leave_out_non_finite_rows_like_the_reference(interpreter):
    """The GPU planner's summary kernel (here in the interpreter) against the torch reference in
    float64 with bad rows: the same entries are non-finite and the others agree (fp32 tolerance)."""
    rng = random.Random(8)
    g = torch.Generator().manual_seed(8)
    tiling = cube_tiling(SMALL, 64)
    k, v = torch.randn(2, 1, 2, SMALL.total, D, generator=g)
    for x in (k, k, k, v, v):
        x[0, rng.randrange(2), rng.randrange(SMALL.total), rng.randrange(D)] = rng.choice(BAD_VALUES)
    k[0, 0, :24] = float("nan")  # every key of the text block
    anchor = torch.randn(1, 2, D, generator=g)
    for fused, ref, text_bias in (  # the all-NaN text block: no reweighted summary; its mean is 0 with log(24)
        (block_summaries_triton(k, v, tiling.k_perm, tiling.block_len, 64, anchor),
         reweight_summaries(k.double(), v.double(), tiling, anchor.double()), -math.inf),
        (block_summaries_triton(k, v, tiling.k_perm, tiling.block_len, 64, None),
         mean_summaries(k.double(), v.double(), tiling),
         math.log(24))):
        for got, want in zip(fused, ref):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, equal_nan=True)
        key, _, bias = fused
        assert torch.isfinite(key).all()
        assert torch.isfinite(bias[:, :, 1:]).all()
        assert float(bias[0, 0, 0]) == pytest.approx(text_bias)
        assert torch.equal(key[0, 0, 0], torch.zeros(D))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batch_or_heads_and_short_sequences_on_every_tiling(backend, interpreter):
    combos = COMBOS if backend == "torch" else random.Random(6).sample(COMBOS, 6)  # the interpreter is slow
    for tail, tiling, granularity in combos:
        cfg = SparseConfig(tail=tail, tiling=tiling, tail_granularity=granularity, kernel=backend)
        for shape in ((0, 2, LAYOUT.total, D), (1, 0, LAYOUT.total, D), (0, 0, SHORT.total, D)):
            layout = LAYOUT if shape[2] == LAYOUT.total else SHORT
            q = torch.randn(shape)
            out = run(q, q, q, layout, cfg)
            assert out.shape == q.shape
            assert out.dtype == q.dtype
        # one video block: the budget is the whole region, so sparse attention is dense attention
        # (plus the coarse branch, zero without a gate)
        dtype = torch.float32 if backend == "triton" else torch.float64
        q, k, v = torch.randn(3, 1, 2, SHORT.total, D, generator=torch.Generator().manual_seed(5), dtype=dtype)
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        torch.testing.assert_close(sparse_attention(q, k, v, SHORT, cfg.replace(topk_ratio=0.1)), dense,
                                   atol=2e-5 if backend == "triton" else 1e-12, rtol=0)


def test_a_layout_without_target_video_is_refused():
    with pytest.raises(ValueError, match="exactly one target 'video' segment, found 0"):
        SequenceLayout.from_segments([(0, 64, "text")])


def wrong_objects(seed: int, like: torch.Tensor) -> list:
    rng = random.Random(seed)
    return [None, [], {}, "q", b"q", rng.randint(-9, 9), rng.random(), np.zeros(like.shape), like.tolist()[:1],
            (like,), {"q": like}, object(), SparseConfig(), LAYOUT]


def refused_before_planning(monkeypatch, call, *names: str) -> Exception:
    def planned(*args, **kwargs):
        raise AssertionError("a bad input reached the planner")

    monkeypatch.setattr(attention, "build_plan", planned)
    start = time.perf_counter()
    with pytest.raises((TypeError, ValueError)) as err:
        call()
    assert time.perf_counter() - start < 1.0
    for name in names:
        assert name in str(err.value), f"{name!r} is not named in: {err.value}"
    monkeypatch.undo()
    return err.value


def test_wrong_kinds_of_argument_name_the_argument(monkeypatch):
    q = torch.randn(1, 2, SHORT.total, D)
    good = {"q": q, "k": q, "v": q, "layout": SHORT, "config": SparseConfig(tail="coarse")}
    for arg in ("q", "k", "v", "layout", "config"):
        for value in wrong_objects(len(arg), q):
            if arg == "config" and value is None or arg == "layout" and value is LAYOUT:
                continue  # None is the default config; LAYOUT is a layout (its length is checked below)
            if arg == "config" and isinstance(value, SparseConfig):
                continue
            kwargs = {**good, arg: value}
            refused_before_planning(monkeypatch, lambda: sparse_attention(**kwargs), f"{arg}")
    err = refused_before_planning(monkeypatch, lambda: sparse_attention(q, q, q, LAYOUT), "sequence length 13")
    assert "344" in str(err)
    for bad in (None, 5, "text", {"segments": []}, [(0, 8, "video", 5)], [(0, 8, "video", (True, 2, 4))],
                [(0, 8, ["video"], (2, 2, 2))], [[0.5, 8, "video", (2, 2, 2)]]):
        with pytest.raises((TypeError, ValueError), match="SequenceLayout"):
            SequenceLayout.from_segments(bad)
    with pytest.raises(TypeError, match="SequenceLayout"):
        SequenceLayout([(0, 8, "video", (2, 2, 2))])


def test_mismatched_tensors_say_which_has_what(monkeypatch):
    q = torch.randn(1, 2, SHORT.total, D)
    err = refused_before_planning(monkeypatch, lambda: sparse_attention(q, q.double(), q, SHORT), "q, k, v")
    assert "q (1, 2, 13, 32) torch.float32 on cpu" in str(err)
    assert "k (1, 2, 13, 32) torch.float64 on cpu" in str(err)
    err = refused_before_planning(monkeypatch, lambda: sparse_attention(q, q, q.to("meta"), SHORT), "v")
    assert "on meta" in str(err)


def test_random_gate_shapes_broadcast_or_are_named(monkeypatch):
    rng = random.Random(3)
    q = torch.randn(1, 2, SHORT.total, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cfg = SparseConfig(tail="coarse", tiling="cube", kernel="torch")
    ungated, info = sparse_attention(q, q, q, SHORT, cfg, return_info=True)
    for _ in range(24):
        shape = tuple(rng.choice([0, 1, 2, 3, SHORT.total, D]) for _ in range(rng.randint(0, 5)))
        if math.prod(shape) > 1 << 16:  # keep the test's own tensors small
            continue
        gate = torch.rand(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(len(shape)))
        fits = len(shape) <= 4 and all(g in (1, n) for g, n in zip(shape[::-1], q.shape[::-1]))
        if fits:
            torch.testing.assert_close(sparse_attention(q, q, q, SHORT, cfg, coarse_gate=gate),
                                       ungated + gate * coarse_branch(q, q, q, info.plan, cfg.tail_granularity),
                                       atol=1e-14, rtol=0)
        else:
            refused_before_planning(monkeypatch, lambda: sparse_attention(q, q, q, SHORT, cfg, coarse_gate=gate),
                                    "coarse_gate", str(shape))
    for gate in ([1.0], 0.5, torch.ones(2, 1, 1, dtype=torch.int64), torch.ones(2, 1, 1, device="meta")):
        refused_before_planning(monkeypatch, lambda: sparse_attention(q, q, q, SHORT, cfg, coarse_gate=gate),
                                "coarse_gate")


def test_gradients_run_on_the_reference_and_are_refused_up_front_by_triton(interpreter):
    """Shorter than one block, sparse attention is dense and so are its gradients. On a sparse
    plan with summaries (selection fixed, so the output is smooth in q, k, v nearby) autograd's
    directional derivatives match central differences in float64 (step 1e-6: agreement to ~1e-9
    relative, asserted 1e-6)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, SHORT.total, D, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    dense = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q, k, v).square().sum(), (q, k, v))
    ours = torch.autograd.grad(sparse_attention(q, k, v, SHORT, SparseConfig(kernel="torch")).square().sum(), (q, k, v))
    for a, b in zip(ours, dense):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    cfg = SparseConfig(kernel="torch", topk_ratio=0.25, tiling="cube", tail="reweight")
    qkv = [torch.randn(1, 2, LAYOUT.total, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    _, info = sparse_attention(*qkv, LAYOUT, cfg, return_info=True)
    assert info.plan.summary_mask().any()
    assert info.density < 0.7

    def loss(*xs):
        return sparse_attention(*xs, LAYOUT, cfg).square().sum()

    grads = torch.autograd.grad(loss(*qkv), qkv)
    with torch.no_grad():
        for i, grad in enumerate(grads):
            step = 1e-6 * torch.randn(grad.shape, generator=g, dtype=torch.float64)
            ahead, behind = list(qkv), list(qkv)
            ahead[i], behind[i] = qkv[i] + step, qkv[i] - step
            assert float((loss(*ahead) - loss(*behind)) / 2) == pytest.approx(float((grad * step).sum()), rel=1e-6)
    q32 = q.detach().float().requires_grad_()
    with pytest.raises(ValueError, match="q require grad, but the fused kernels have no backward"):
        sparse_attention(q32, k.detach().float(), v.detach().float(), SHORT, SparseConfig(kernel="triton"))
    with torch.no_grad():
        out = sparse_attention(q32, q32, q32, SHORT, SparseConfig(kernel="triton"))
    assert not out.requires_grad
    assert math.isfinite(float(out.abs().sum()))
