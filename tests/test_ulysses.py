"""Ulysses sequence parallelism on 2 CPU processes (torch.distributed, gloo) against one process.

Every check runs in the same pair of ranks (one process-group start-up for the file; forked, or
spawned where CUDA is available, since a forked child cannot use CUDA once the parent has):
- the engine's all-to-all -> sparse attention on H/2 heads -> all-to-all back equals the
  single-process output rows, and each rank's plan equals the single-process plan of its heads;
- the same with the Triton kernels on the strided post-all-to-all views (compiled on the GPU
  where there is one, the all-to-all still on the CPU; else in the interpreter);
- the Raylight adapter through a mirror of Raylight's USP path (tests/raylight_mirror.py): a tiny
  H3 model split over 2 ranks equals the single-process model with sparse attention.
Torch backend in float64: only the batching of heads differs, so outputs agree to 1e-12 and the
integer tables exactly. The Triton kernel sees the same per-head inputs (other strides), so fp32
outputs agree to 1e-6.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from triton_interpreter import kernel_imports

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
if HAS_TRITON:
    with kernel_imports():  # before the package (which may import Triton) and before the ranks start
        import triton  # noqa: F401

from adaptive_sparse_attention import SequenceLayout, SparseConfig, sparse_attention  # noqa: E402
from adaptive_sparse_attention.backend.ulysses import (check_sequence_parallel, degrees_dividing,  # noqa: E402
                                                       local_heads_attention, seq_to_heads,
                                                       sequence_parallel_attention)
from adaptive_sparse_attention.nodes.model_patches import DiffusionModelWrapper, block_hooks  # noqa: E402
from adaptive_sparse_attention.nodes.block_hook import bind  # noqa: E402
from adaptive_sparse_attention.nodes.raylight import RaylightSparseAttention  # noqa: E402
from h3_block import MiniMaxH3Model, PackedLayout, block_args, layout_of  # noqa: E402
from h3_harness import Executor, config  # noqa: E402
from raylight_mirror import INNER_ATTENTION_KEY, XFuserAttention, pad_rows, usp_attention, usp_forward  # noqa: E402

WORLD, HEADS = 2, 4
# 201 rows: edge blocks in every region, a reference video, and one padding row at 2 ranks
LAYOUT = SequenceLayout.from_segments([(0, 22, "text"), (22, 62, "ref_video", (2, 4, 5)), (62, 81, "audio"),
                                       (81, 201, "video", (4, 5, 6))])
# the Triton interpreter is slow: a smaller sequence for it (and for the compiled kernels)
TRITON_LAYOUT = SequenceLayout.from_segments([(0, 11, "text"), (11, 131, "video", (2, 6, 10))])


ENGINE_CONFIGS = [config(tiling="cube", topk_ratio=0.3),
                  config(tiling="reblock", sparse_scope="joint-video", tail_granularity="block", topk_ratio=0.25),
                  config(tiling="reblock", reblock_layout="independent", tail="mean", block_size=128, topk_ratio=0.3)]


def qkv(dtype: torch.dtype, seed: int = 0, layout: SequenceLayout = LAYOUT) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, HEADS, layout.total, 32, generator=g, dtype=dtype) for _ in range(3)]


def rows_of(rank: int, t: torch.Tensor) -> torch.Tensor:
    """This rank's rows [B, S/P, H, D] of a [B, H, S, D] tensor, the sequence padded with zeros."""
    padded = pad_rows(t.transpose(1, 2), 1, WORLD)
    s = padded.shape[1] // WORLD
    return padded[:, rank * s:(rank + 1) * s]


def assert_same_plan(whole, local, heads: slice, tol: float) -> None:
    """Every tensor of a rank's plan (its tiling and tail included) equals the single-process
    plan's, sliced to the rank's heads."""
    assert type(whole) is type(local)
    for f in dataclasses.fields(whole):
        a, b = getattr(whole, f.name), getattr(local, f.name)
        if dataclasses.is_dataclass(a):
            assert_same_plan(a, b, heads, tol)
            continue
        if not isinstance(a, torch.Tensor):
            assert a == b, f.name
            continue
        if a.dim() >= 2 and a.shape[1] == HEADS:
            a = a[:, heads]
        exact = not a.is_floating_point()
        torch.testing.assert_close(b, a, rtol=0, atol=0 if exact else tol, msg=lambda m: f"{f.name}: {m}")


def check_engine(rank: int) -> None:
    heads = slice(rank * HEADS // WORLD, (rank + 1) * HEADS // WORLD)
    for cfg in ENGINE_CONFIGS:
        q, k, v = qkv(torch.float64)
        whole, info = sparse_attention(q, k, v, LAYOUT, cfg, return_info=True)
        out, local = sequence_parallel_attention(*(rows_of(rank, t) for t in (q, k, v)), LAYOUT, cfg,
                                                 return_info=True)
        torch.testing.assert_close(out, rows_of(rank, whole), rtol=0, atol=1e-12)
        assert_same_plan(info.plan, local.plan, heads, 1e-12)
        assert local.budgets == info.budgets


def check_triton(rank: int) -> None:
    heads = slice(rank * HEADS // WORLD, (rank + 1) * HEADS // WORLD)
    cfg = config(tiling="cube", kernel="triton")  # per-head reblock plans are checked on the torch backend above;
    # here the Triton kernels read the strided head views (a reblock plan would run its tree in the interpreter too)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if CUDA else torch.device("cpu")
    q, k, v = qkv(torch.float32, seed=1, layout=TRITON_LAYOUT)
    local_q, local_k, local_v = (seq_to_heads(rows_of(rank, t)).to(device) for t in (q, k, v))  # strided views inside
    q, k, v = (t.to(device) for t in (q, k, v))
    out, local = local_heads_attention(local_q, local_k, local_v, TRITON_LAYOUT, cfg, return_info=True)
    alone, info = sparse_attention(q[:, heads], k[:, heads], v[:, heads], TRITON_LAYOUT, cfg, return_info=True)
    assert local.kernel == info.kernel == "triton"
    torch.testing.assert_close(out[:, :TRITON_LAYOUT.total], alone.transpose(1, 2), rtol=0, atol=1e-6)
    assert out[:, TRITON_LAYOUT.total:].abs().max() == 0  # the padding row
    assert_same_plan(info.plan, local.plan, slice(None), 1e-6)


def single_process(model, args: dict, layout: SequenceLayout, cfg: SparseConfig) -> torch.Tensor:
    """The model on one process: sparse attention in the layers the config allows, dense in the others."""
    h = args["img"].clone()
    for i, block in enumerate(model.blocks):
        def attention(x, rope_freqs=None, transformer_options=None, attn=block.attn, dense=i in cfg.dense_layers):
            if dense:
                return type(attn).forward(attn, x, rope_freqs)
            q, k, v = attn.qkv(x, rope_freqs)
            out = sparse_attention(q, k, v, layout, cfg)
            return attn.out_proj(out[0].transpose(0, 1).reshape(x.shape[0], -1))
        h = block.run(h, args["t_emb"], args["mod_segments"], args["rope_freqs"], {}, attention)
    return h


def check_raylight_path(rank: int) -> None:
    # 267 rows (one padding row, all layers sparse) and 268 rows (no padding, so Raylight's dense
    # attention in layer 1 is exact too)
    for packed, cfg in ((PackedLayout(5, 4, 16, 16, 3), config(tiling="reblock")),
                        (PackedLayout(6, 4, 16, 16, 3), config(tiling="cube", dense_layers="1"))):
        torch.manual_seed(3)
        model = MiniMaxH3Model(layers=2, hidden=32, heads=HEADS, head_dim=32).double().requires_grad_(False)
        args = block_args(model.blocks[0], packed, seed=4, new=False)  # Raylight passes no "layout"
        expected = single_process(model, args, layout_of(packed), cfg)

        xfuser = XFuserAttention()
        for block in model.blocks:
            block.attn.forward = usp_attention(block.attn, xfuser)
        processor = RaylightSparseAttention(cfg, HEADS, WORLD)
        marks, _ = block_hooks(model, processor, {}, {}, swap=False)
        bind(model, processor)
        sched = torch.linspace(1.0, 0.0, 11, dtype=torch.float64)
        options = {"sigmas": sched[3:4].float(), "sample_sigmas": sched.float(), INNER_ATTENTION_KEY: processor,
                   "patches_replace": {"dit": {("double_block", i): fn for i, fn in marks.items()}}}
        text, t, h, w, audio = packed.signature
        x = [torch.zeros(1, 24, t, h, w), torch.zeros(1, 32, 2, audio)]
        out = DiffusionModelWrapper(processor.key)(Executor(model, usp_forward(model, args)), x, None,
                                                   torch.zeros(1, text, 48), options, minimax_payload={"layout": packed})
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
        stats = processor.tracker.stats
        assert (stats.sparse_blocks, stats.dense_blocks) == (2 - len(cfg.dense_layers), len(cfg.dense_layers))


def rank_main(rank: int, path: str) -> None:
    torch.set_num_threads(1)
    if not CUDA:  # the interpreter runs the Triton kernels on CPU tensors (this process only)
        os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    try:
        check_engine(rank)
        check_raylight_path(rank)
        if HAS_TRITON:
            check_triton(rank)
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one_process(tmp_path):
    mp.start_processes(rank_main, args=(str(tmp_path / "process_group"),), nprocs=WORLD,
                       start_method="spawn" if CUDA else "fork")


def test_refusals_name_the_degree_and_what_is_allowed():
    assert degrees_dividing(56) == [1, 2, 4, 7, 8, 14, 28, 56]
    check_sequence_parallel(56, 8)
    with pytest.raises(ValueError, match=r"ulysses_degree=3 is not supported: it must divide the model's 56 "
                                         r"attention heads, one of 1, 2, 4, 7, 8, 14, 28, 56"):
        check_sequence_parallel(56, 3)
    with pytest.raises(ValueError, match=r"ulysses_degree=0"):
        check_sequence_parallel(56, 0)
    with pytest.raises(ValueError, match=r"ring_degree=2 is not supported .*pooled keys from every rank.*"
                                         r"log-sum-exp"):
        check_sequence_parallel(56, 2, 2)
    with pytest.raises(ValueError, match=r"ulysses_degree=3"):
        RaylightSparseAttention(config(), 56, 3)
    with pytest.raises(ValueError, match=r"S >= the layout's 201 rows"):
        local_heads_attention(*(t[:, :, :200].transpose(1, 2) for t in qkv(torch.float64)), LAYOUT, config())
