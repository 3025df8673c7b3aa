"""GPU timing of the reblock tiling at an H3 shape, against the plan and the sparse kernel.

    python -m adaptive_sparse_attention reblock-timing [--out FILE] [--video T H W] [--heads H] [--profile]

Times (CUDA events, median after warm-up) `reblock_tiling` in both layout modes and its two
stages (metric features, tree partition), `build_plan` with reblock vs cube tiling, and, when
the Triton kernel runs, the sparse attention kernel at ratio 0.1 (the 15% budget is measured
against it). It also checks that the tiling makes no host synchronisation (CUDA sync debug
mode) and gives the same bits twice, how much of the fused levels' tiling equals the torch
levels' (the kernels' fused multiply-adds round differently, so near-ties may differ), times
the per-head choice between the tree and the tubes (`backend/head_choice.py`) on its own, and
the tiling with and without the partition's CUDA graph and the partition with and without the
fused levels. Every `*_queued` time is the device time with the launches queued behind a busy
GPU (`timing.queued_ms`), as inside a model's forward pass where the host runs ahead; the plain
times include the gaps while the host enqueues. The longest host enqueue time of every queued
call is reported too (`queued_host_enqueue_ms`: below the 100 ms lead, no call blocked the
host). Inputs are random bf16 (the cost depends on shapes only).
"""
from __future__ import annotations

import argparse
import json

import torch

from ..backend.config import SparseConfig
from ..backend.layout import SequenceLayout
from .scenes import SceneSize
from ..backend.planner import build_plan
from ..backend import reblock
from ..backend.reblock_partition import partition
from ..backend.head_choice import choose_tubes
from ..kernels.registry import resolve
from .timing import queued_ms, time_call


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--video", type=int, nargs=3, default=(72, 24, 42))
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one partition call")


def run(args: argparse.Namespace) -> int:
    """Every timing and check above; prints the JSON after each stage (and writes it to args.out
    when given) and the times at the end. Returns 0."""
    dev = torch.device("cuda")
    T, Hh, W = args.video
    layout = SceneSize(256, 810, (T, Hh, W), args.heads, 128).layout()  # the 10s preset's prefix
    S, H, D = layout.total, args.heads, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    triton = resolve("triton", dev, torch.bfloat16, strict=True, head_dim=D, block_size=64)
    res: dict = {"shape": {"B": 1, "H": H, "S": S, "D": D, "video": [T, Hh, W], "dtype": "bf16", "block": 64},
                 "device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save() -> None:
        print(json.dumps(res), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    reserved = torch.cuda.memory_reserved()
    for mode in ("q_reuse_k", "independent"):  # build the static schedule, capture the graphs
        reblock.reblock_tiling(q, k, layout, 64, mode, kernels=triton)
    torch.cuda.synchronize()
    res["memory_gb"] = {"reserved_by_first_calls": (torch.cuda.memory_reserved() - reserved) / 2**30}
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    eager = SequenceLayout(layout.segments)  # the same layout without CUDA graphs
    eager.cache.graphs = False
    reblock.reblock_tiling(q, k, eager, 64, kernels=triton)
    res["memory_gb"]["eager_tiling_peak"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    torch.cuda.set_sync_debug_mode("error")
    try:
        reblock.reblock_tiling(q, k, layout, 64, "independent", kernels=triton)
        res["host_sync"] = "none"
    except RuntimeError as e:
        res["host_sync"] = f"FOUND: {e}"
    finally:
        torch.cuda.set_sync_debug_mode(0)

    seg = layout.target
    a = reblock.reblock_tiling(q, k, layout, 64, "independent", kernels=triton)
    b = reblock.reblock_tiling(q, k, layout, 64, "independent", kernels=triton)
    lo = a.region_blocks[-1][0] * 64
    rows = a.k_perm[0, :, lo:].long()
    res["checks"] = {
        "same_bits": bool(torch.equal(a.q_perm, b.q_perm) and torch.equal(a.k_perm, b.k_perm)),
        "target_bijection": bool(torch.equal(rows[rows >= 0].view(H, -1).sort(-1).values,
                                             torch.arange(seg.start, seg.stop, device=dev).expand(H, -1))),
    }
    qs = q[:, :, seg.start:seg.stop].reshape(H, seg.length, D)
    ks = k[:, :, seg.start:seg.stop].reshape(H, seg.length, D)
    schedule = reblock.cached_static(layout, 64, dev).parts[-1]
    z = reblock.metric_features(ks, qs, triton)
    res["checks"]["graph_equals_eager"] = bool(torch.equal(reblock.run_partition(z, schedule, 64, triton, layout.cache, seg.start),
                                                           partition(z, schedule, triton)))
    torch_levels = partition(z, schedule)  # every level on the torch path
    res["checks"]["fused_levels_agree_with_torch_levels"] = float(
        (partition(z, schedule, triton) == torch_levels).double().mean())
    t, host = {}, {}
    for graphs in (True, False):
        suffix = "" if graphs else "_eager"
        for mode in ("q_reuse_k", "independent"):
            def fn(mode=mode, graphs=graphs):
                return reblock.reblock_tiling(q, k, layout if graphs else eager, 64, mode, kernels=triton)
            name = f"tiling_{mode}{suffix}"
            t[name] = time_call(fn, dev, 3, 10)
            t[f"{name}_queued"], host[name] = queued_ms(fn, dev, 2, 5)
    t["features"] = time_call(lambda: reblock.metric_features(ks, qs, triton), dev, 3, 10)
    t["partition_graph"] = time_call(lambda: reblock.run_partition(z, schedule, 64, triton, layout.cache, seg.start), dev, 3, 10)
    t["partition_eager"] = time_call(lambda: partition(z, schedule, triton), dev, 3, 10)
    t["partition_eager_torch_levels"] = time_call(lambda: partition(z, schedule), dev, 3, 10)
    res["ms"] = t
    save()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            partition(z, schedule, triton)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    save()

    t["dense_sdpa"] = time_call(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), dev, 1, 3)
    configs = {tiling: SparseConfig(topk_ratio=0.1, tiling=tiling, kernels=triton) for tiling in ("cube", "reblock")}
    for tiling, cfg in configs.items():
        t[f"plan_{tiling}"] = time_call(lambda: build_plan(q, k, v, layout, cfg), dev, 2, 5)
    tree = reblock.reblock_tiling(q, k, layout, 64, tubes=False, kernels=triton).k_perm.unsqueeze(0)
    queued = {"tiling_tree_only": lambda: reblock.reblock_tiling(q, k, layout, 64, tubes=False, kernels=triton),
              "head_choice": lambda: choose_tubes(q, k, tree, layout, 64, a.region_blocks[-1], 0.1, triton),
              "features": lambda: reblock.metric_features(ks, qs, triton),
              "partition_graph": lambda: reblock.run_partition(z, schedule, 64, triton, layout.cache, seg.start),
              **{f"plan_{tiling}": (lambda cfg=cfg: build_plan(q, k, v, layout, cfg)) for tiling, cfg in configs.items()}}
    for name, fn in queued.items():
        t[f"{name}_queued"], host[name] = queued_ms(fn, dev, 2, 5)
    res["queued_host_enqueue_ms"] = host
    save()
    for tiling, cfg in configs.items():
        plan = build_plan(q, k, v, layout, cfg)
        try:
            t[f"kernel_{tiling}"] = time_call(lambda: triton.attention.attend_blocks(q, k, v, plan), dev, 2, 5)
        except Exception as e:  # the kernel belongs to another module; report, keep the tiling numbers
            res[f"kernel_{tiling}_error"] = repr(e)[:300]
    if "kernel_reblock" in t:
        res["tiling_share_of_kernel"] = t["tiling_q_reuse_k"] / t["kernel_reblock"]
        res["tiling_eager_share_of_kernel"] = t["tiling_q_reuse_k_eager"] / t["kernel_reblock"]
        res["plan_share_of_kernel"] = t["plan_reblock"] / t["kernel_reblock"]
        res["plan_queued_share_of_kernel"] = t["plan_reblock_queued"] / t["kernel_reblock"]
    save()
    print("\n".join(f"{name:28s} {ms:9.3f} ms" for name, ms in t.items()))
    return 0
