"""Kernel-only and whole-call time at the H3 shapes against dense cuDNN SDPA (section `timing`).

Per shape (56 heads, head dim 128, bf16), block size, ratio, tail granularity and arch: the
kernel on the cube plan with reweight tails; for the last arch also the whole
`sparse_attention` call, planning included; where the cuDNN backend can run, its rows
(`cudnn_timing.py`). At the 10s shape also the launch-config variants and the planner per step.
"""
from __future__ import annotations

import torch

from adaptive_sparse_attention.backend.attention import sparse_attention
from adaptive_sparse_attention.backend.layout import SequenceLayout
from adaptive_sparse_attention.backend.tail import block_reduce
from adaptive_sparse_attention.bench.planner_timing import steps
from adaptive_sparse_attention.bench.scenes import h3_qkv
from adaptive_sparse_attention.bench.timing import bench_ms
from adaptive_sparse_attention.kernels.arch import ARCHS, kernel_config
from adaptive_sparse_attention.kernels.registry import unavailable_reason
from cudnn_timing import cudnn_row
from kernel_cases import DIM, H3_SHAPES, HEADS, plan_for
from kernel_rows import kernel_row
from kernel_variants import compiled_resources, variant_rows


def planner_profile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                    ratio: float) -> dict:
    """Milliseconds per planner step (bench/planner_timing.py's steps: cube tiling, reweight
    tails) plus the block-granularity reduction."""
    parts = steps(q, k, v, layout, ratio)
    results = {name: fn() for name, fn in parts.items()}
    out = {name: bench_ms(fn, rep_ms=300) for name, fn in parts.items()}
    plan = results["build_plan reweight"]
    key, value, bias = results["reweight_summaries"]
    out["block_reduce (block gran.)"] = bench_ms(
        lambda: block_reduce(results["block_means q"], key, value, bias, plan.dense_hi, plan.q2k_idx,
                             plan.q2k_num), rep_ms=300)
    return out


def shape_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, entry: dict,
               ratios: list[float], block_sizes: list[int], dense_ms: float, dense_tflops: float) -> None:
    """The kernel (and whole-call, cuDNN) rows of one shape, appended to entry["rows"] / entry["cudnn"]."""
    for bs in block_sizes:
        for ratio in ratios:
            for gran in ("query", "block"):
                if gran == "block" and ratio != 0.1:
                    continue
                plan, cfg = plan_for(q, k, v, layout, ratio, gran, bs)
                for arch in ARCHS:
                    conf = kernel_config(DIM, plan.block_size, q.device, arch=arch)
                    row = dict(block_size=bs, ratio=ratio, gran=gran, arch=arch,
                               **kernel_row(q, k, v, plan, conf, dense_ms, dense_tflops))
                    if arch == ARCHS[-1]:
                        row["sparse_attention_ms"] = bench_ms(lambda: sparse_attention(q, k, v, layout, cfg),
                                                              rep_ms=1500)
                        row["sparse_attention_vs_dense"] = row["sparse_attention_ms"] / dense_ms
                    entry["rows"].append(row)
                    if bs == 64 and arch == ARCHS[-1] and unavailable_reason("cudnn", q.device, q.dtype, DIM, bs) is None:
                        entry.setdefault("cudnn", []).append(
                            cudnn_row(q, k, v, plan, layout, ratio, gran, dense_ms, dense_tflops))
                    extra = (f" | whole op {row['sparse_attention_ms']:.1f} ms "
                             f"({100 * row['sparse_attention_vs_dense']:.1f}% of dense)"
                             ) if "sparse_attention_ms" in row else ""
                    print(f"  bs{bs} r{ratio} {gran:5s} {arch}: kernel {row['kernel_ms']:.2f} ms "
                          f"{row['tflops']:.0f} TFLOP/s ({100 * row['vs_dense_rate']:.0f}% of dense rate, "
                          f"{100 * row['vs_dense_time']:.1f}% of dense time)" + extra, flush=True)


def timing(results: dict, shapes: list[str], ratios: list[float], block_sizes: list[int],
           variants: bool = True) -> None:
    """Every shape's rows into results["timing"][shape], then results["compiled"].

    Args:
        results: the check's results, extended in place.
        shapes: H3 shapes to time (5s, 10s, 14s).
        ratios: top-k ratios (the block granularity is timed at 0.1 only).
        block_sizes: plan block sizes.
        variants: also time the launch-config variants and the planner at the 10s shape.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    results["timing"] = {}
    for name in shapes:
        layout = H3_SHAPES[name].layout()
        S = layout.total
        q, k, v = h3_qkv(layout, HEADS, DIM, torch.bfloat16, seed=7)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            dense_ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), rep_ms=3000)
        dense_tflops = 4 * DIM * HEADS * S * S / dense_ms / 1e9
        entry = {"S": S, "dense_cudnn_ms": dense_ms, "dense_cudnn_tflops": dense_tflops, "rows": []}
        print(f"{name}: S {S} dense cuDNN {dense_ms:.1f} ms {dense_tflops:.0f} TFLOP/s", flush=True)
        if name == "10s" and variants:
            entry["variants_ratio_0.1"] = variant_rows(q, k, v, layout, dense_ms, dense_tflops)
            print("  compiled:", compiled_resources(), flush=True)
            entry["planner_ms_ratio_0.1"] = planner_profile(q, k, v, layout, 0.1)
            print("  planner:", {n: round(t, 2) for n, t in entry["planner_ms_ratio_0.1"].items()}, flush=True)
        shape_rows(q, k, v, layout, entry, ratios, block_sizes, dense_ms, dense_tflops)
        results["timing"][name] = entry
        q = k = v = None  # free this shape's tensors before the next one
        torch.cuda.empty_cache()
    results["compiled"] = compiled_resources()
