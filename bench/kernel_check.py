"""GPU check and timing of the fused Triton kernel (run on a CUDA machine, one call).

    python -m adaptive_sparse_attention kernel-check --out DIR [--quick]

1. Correctness at ~8k tokens against the float64 reference: relative L2 and max error per
   dtype, head_dim, tail granularity and forced architecture family (outputs are poisoned first,
   so an unwritten row shows up as NaN); identical bits across repeated runs.
2. compute-sanitizer memcheck on a small case, in a child process, where the tool exists; Nsight
   Compute sections (occupancy, stall reasons, memory and pipe throughput) of one launch.
3. Kernel-only time at the H3 shapes (5s/10s/14s, 56 heads, head_dim 128, bf16, cube tiling,
   reweight tails) at ratios 0.1/0.2/0.3, against dense cuDNN SDPA in the same run; throughput
   counts the pairs the kernel computes (exact query-key pairs plus summary columns). Where the
   cuDNN backend can run: the anchor (cuDNN-frontend's block-sparse kernel alone on the same
   exact keys), the cuDNN backend, and the whole call with the default tiling on both backends.
4. The kernel with every block exact (5s shape) against cuDNN, gathered and in model order.
5. Launch-config variants at the 10s shape, ratio 0.1 (section `variants`); each family's
   configs at every shape.
6. The whole `sparse_attention` call (planning included) and the planner per component.
Writes DIR/kernel_check.json and DIR/kernel_check.md and prints the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

from ..backend.attention import sparse_attention
from ..backend.config import SparseConfig
from ..backend.layout import SequenceLayout
from .planner_timing import steps
from .runner import environment
from .scenes import SIZES, h3_qkv
from .timing import bench_ms, queued_ms
from ..backend.planner import build_plan, make_tiling
from ..backend.tail import block_reduce
from ..kernels.configs import CONFIGS, FAMILIES, KernelConfig, finish_config, kernel_config
from ..kernels.table import unavailable_reason
from ..kernels.plan import BlockSparsePlan, BlockSummaries, QuerySummaries, Tiling
from ..kernels.reference import block_sparse_reference
from ..kernels.triton_attention import block_sparse_triton

H3_SHAPES = {name: SIZES[f"h3-{name}"] for name in ("5s", "10s", "14s")}  # the bench presets' shapes
HEADS, DIM = H3_SHAPES["10s"].heads, H3_SHAPES["10s"].head_dim
VARIANTS = {  # launch-config variants timed at the 10s shape, ratio 0.1: name -> (plan block size, config)
    "bs64 m64n64t64w4s2": (64, KernelConfig(64, 64, 64, 4, 2)),
    "bs64 m64n64t64w4s3": (64, KernelConfig(64, 64, 64, 4, 3)),
    "bs128 m64n64t64w4s3": (128, KernelConfig(64, 64, 64, 4, 3)),
    "bs128 m128n64t64w8s2": (128, KernelConfig(128, 64, 64, 8, 2)),
    "bs128 m128n64t64w8s3": (128, KernelConfig(128, 64, 64, 8, 3)),
    "bs128 m128n128t64w8s2": (128, KernelConfig(128, 128, 64, 8, 2)),
}


def computed_pairs(plan: BlockSparsePlan) -> tuple[float, float]:
    """(exact query-key pairs, summary pairs) the kernel computes, summed over batch and heads."""
    blen = plan.block_len.long()
    prefix = torch.cat([blen.new_zeros(1), blen.cumsum(0)])
    J, R = plan.num_blocks, plan.q2k_idx.shape[-1]
    valid = torch.arange(R, device=blen.device) < plan.q2k_num.unsqueeze(-1)
    picked = torch.where(valid, blen[plan.q2k_idx.long().clamp(min=0)], 0).sum(-1)
    exact = ((prefix[plan.dense_hi.long()] + picked) * blen).sum()
    summary = 0.0
    if isinstance(plan.tail, QuerySummaries):
        summary = float((((J - plan.dense_hi.long()) - plan.q2k_num.long()) * blen).sum())
    elif isinstance(plan.tail, BlockSummaries):
        summary = float(blen.sum()) * plan.q2k_num.shape[0] * plan.q2k_num.shape[1]
    return float(exact), summary


def poison_allocator(nbytes: int) -> None:
    """Fill freed allocator memory with NaN so that rows the kernel fails to write show up."""
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


def correctness(results: dict, quick: bool, block_size: int) -> None:
    layout = SequenceLayout.from_segments([(0, 256, "text"), (256, 670, "audio"),
                                           (670, 670 + 4 * 24 * 30, "ref_video", (4, 24, 30)),
                                           (3550, 3550 + 7 * 21 * 30, "video", (7, 21, 30))])  # S = 7960
    cases = [(torch.bfloat16, 128, "query"), (torch.bfloat16, 128, "block"), (torch.float16, 64, "query"),
             (torch.bfloat16, 32, "block")] if block_size == 64 else [
             (torch.bfloat16, 128, "query"), (torch.float16, 64, "block"), (torch.bfloat16, 32, "query")]
    rows = []
    for dtype, dim, gran in cases:
        q, k, v = h3_qkv(layout, 4, dim, dtype, seed=dim)
        cfg = SparseConfig(tiling="cube", topk_ratio=0.15, sparse_scope="joint-video", tail_granularity=gran,
                           block_size=block_size)
        plan = build_plan(q, k, v, layout, cfg)
        ref, ref_lse = block_sparse_reference(q.double(), k.double(), v.double(), plan)
        low, _ = block_sparse_reference(q, k, v, plan)  # fp32 math, output rounded to dtype
        low_err = float((low.double() - ref).abs().max())
        for fam in FAMILIES:
            conf = kernel_config(dim, plan.block_size, q.device, family=fam)
            poison_allocator(4 * q.numel() * q.element_size())
            out, lse = block_sparse_triton(q, k, v, plan, config=conf)
            again = [block_sparse_triton(q, k, v, plan, config=conf) for _ in range(2)]
            same = all(torch.equal(o, out) and torch.equal(l, lse) for o, l in again)
            err = (out.double() - ref)
            row = dict(dtype=str(dtype).split(".")[-1], dim=dim, gran=gran, block_size=block_size, family=fam,
                       config=conf.__dict__,
                       rel_l2=float(err.norm() / ref.norm()), max_abs=float(err.abs().max()),
                       ref_lowprec_max_abs=low_err, lse_max_abs=float((lse.double() - ref_lse).abs().max()),
                       finite=bool(torch.isfinite(out).all()), bit_identical=same)
            row["ok"] = row["finite"] and same and row["rel_l2"] < 1e-2 and row["max_abs"] < max(4 * low_err, 2e-2) \
                and row["lse_max_abs"] < 1e-3
            rows.append(row)
            print(f"check bs{block_size} {row['dtype']} D{dim} {gran:5s} {fam}: rel_l2 {row['rel_l2']:.2e} "
                  f"max {row['max_abs']:.2e} (fp32-ref rounded {low_err:.2e}) lse {row['lse_max_abs']:.1e} identical {same} ok {row['ok']}",
                  flush=True)
        if quick:
            break
    results.setdefault("correctness", []).extend(rows)


def sanitize_child() -> None:
    """Small case run under compute-sanitizer by the parent (both granularities, both families, and
    the cuDNN backend where it can run)."""
    layout = SequenceLayout.from_segments([(0, 100, "text"), (100, 100 + 3 * 10 * 12, "video", (3, 10, 12))])
    for gran in ("query", "block"):
        q, k, v = h3_qkv(layout, 2, 128, torch.bfloat16, seed=1)
        plan = build_plan(q, k, v, layout, SparseConfig(tiling="cube", topk_ratio=0.3, tail_granularity=gran))
        for fam in FAMILIES:
            block_sparse_triton(q, k, v, plan, config=kernel_config(128, 64, q.device, family=fam))
        if unavailable_reason("cudnn", q.device, q.dtype, 128, 64) is None:
            from ..kernels.cudnn_attention import block_sparse_cudnn

            block_sparse_cudnn(q, k, v, plan)
    torch.cuda.synchronize()
    print("sanitize-child done")


def profile_child() -> None:
    """One kernel launch at the 5s shape, ratio 0.1, query tails (after two warm-up launches),
    for Nsight Compute run by the parent."""
    layout = H3_SHAPES["5s"].layout()
    q, k, v = h3_qkv(layout, HEADS, DIM, torch.bfloat16, seed=5)
    plan, _ = plan_for(q, k, v, layout, 0.1)
    for _ in range(3):
        block_sparse_triton(q, k, v, plan)
    torch.cuda.synchronize()
    print("profile-child done")


def nsight(results: dict) -> None:
    """Nsight Compute sections of the third kernel launch of `profile_child` (clocks untouched)."""
    tool = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)
    if tool is None:
        results["ncu"] = "ncu not found"
        return
    sections = ["SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis",
                "ComputeWorkloadAnalysis"]
    cmd = [tool, "--clock-control", "none", "--kernel-name", "regex:_block_sparse_fwd", "--launch-skip", "2",
           "--launch-count", "1", *[a for sec in sections for a in ("--section", sec)], sys.executable, "-m",
           "adaptive_sparse_attention", "kernel-check", "--profile-child"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        results["ncu"] = {"returncode": p.returncode, "report": (p.stdout + p.stderr)[-12000:]}
        print(p.stdout[-8000:], p.stderr[-1000:], flush=True)
    except subprocess.TimeoutExpired:
        results["ncu"] = "timed out after 240 s"


def sanitizer(results: dict) -> None:
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        results["sanitizer"] = "compute-sanitizer not found"
        return
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "9", sys.executable, "-m",
           "adaptive_sparse_attention", "kernel-check", "--sanitize-child"]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        tail = (p.stdout + p.stderr)[-1500:]
        results["sanitizer"] = {"returncode": p.returncode, "tail": tail}
        print(f"compute-sanitizer memcheck rc={p.returncode}:", tail[-400:], flush=True)
    except subprocess.TimeoutExpired:
        results["sanitizer"] = "timed out after 300 s"


def plan_for(q, k, v, layout, ratio, gran="query", block_size=64):
    cfg = SparseConfig(tiling="cube", topk_ratio=ratio, tail="reweight", tail_granularity=gran, block_size=block_size)
    return build_plan(q, k, v, layout, cfg), cfg


def kernel_row(q, k, v, plan, conf, dense_ms, dense_tflops):
    exact, summary = computed_pairs(plan)
    ms = bench_ms(lambda: block_sparse_triton(q, k, v, plan, config=conf))
    tflops = 4 * DIM * (exact + summary) / ms / 1e9
    return dict(kernel_ms=ms, exact_pairs=exact, summary_pairs=summary, tflops=tflops,
                vs_dense_rate=tflops / dense_tflops, vs_dense_time=ms / dense_ms, config=conf.__dict__)


def compiled_resources() -> list[dict]:
    """Shared memory, registers and spills of every compiled kernel variant (best effort)."""
    from ..kernels import triton_attention as ta

    seen = []
    try:
        for caches in ta._block_sparse_fwd.device_caches.values():
            for kern in caches[0].values():
                md = kern.metadata
                seen.append(dict(shared=md.shared, warps=md.num_warps, stages=md.num_stages,
                                 regs=getattr(kern, "n_regs", None), spills=getattr(kern, "n_spills", None)))
    except (AttributeError, TypeError, IndexError) as e:
        seen.append({"error": repr(e)})
    return seen


def planner_profile(q, k, v, layout, ratio) -> dict:
    """Milliseconds per planner step (bench/planner_timing.py's steps: cube tiling, reweight
    tails) plus the block-granularity reduction."""
    parts = steps(q, k, v, layout, ratio)
    results = {name: fn() for name, fn in parts.items()}
    out = {name: bench_ms(fn, rep_ms=300) for name, fn in parts.items()}
    plan = results["build_plan reweight"]
    key, value, bias = results["reweight_summaries"]
    out["block_reduce (block gran.)"] = bench_ms(
        lambda: block_reduce(results["block_means q"], key, value, bias, plan.dense_hi, plan.q2k_idx, plan.q2k_num), rep_ms=300)
    return out


def dense_probe(results: dict) -> None:
    """The kernel with nothing skipped (every block exact, no tails) at the 5s shape, against
    cuDNN: separates the cost of the kernel's own loop from that of sparsity. Rows are gathered
    by the cube permutation, or read in model order (identity permutation, contiguous blocks)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layout = H3_SHAPES["5s"].layout()
    S = layout.total
    q, k, v = h3_qkv(layout, HEADS, DIM, torch.bfloat16, seed=3)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        dense_ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), rep_ms=2000)
    flops = 4 * DIM * HEADS * S * S
    rows = {"S": S, "dense_cudnn_ms": dense_ms, "dense_cudnn_tflops": flops / dense_ms / 1e9}
    cube = make_tiling(q, k, layout, SparseConfig(tiling="cube"))
    for name, bs, conf in (("cube gather bs64", 64, kernel_config(DIM, 64, q.device)),
                           ("identity bs64", 64, kernel_config(DIM, 64, q.device)),
                           ("identity bs128", 128, kernel_config(DIM, 128, q.device))):
        J = -(-S // bs)
        if name.startswith("cube"):
            perm, block_len = cube.q_perm, cube.block_len
            J = cube.num_blocks
        else:
            slots = torch.arange(J * bs, device="cuda", dtype=torch.int32)
            perm = torch.where(slots < S, slots, -1).view(1, 1, -1)
            block_len = torch.clamp(S - bs * torch.arange(J, device="cuda", dtype=torch.int32), max=bs)
        plan = BlockSparsePlan(Tiling(bs, perm, perm, block_len), torch.full((J,), J, dtype=torch.int32, device="cuda"),
                               torch.zeros(1, HEADS, J, 0, dtype=torch.int32, device="cuda"),
                               torch.zeros(1, HEADS, J, dtype=torch.int32, device="cuda"))
        ms = bench_ms(lambda: block_sparse_triton(q, k, v, plan, config=conf), rep_ms=2000)
        rows[name] = {"kernel_ms": ms, "tflops": flops / ms / 1e9, "config": conf.__dict__}
        print(f"dense probe 5s {name}: {ms:.1f} ms {flops / ms / 1e9:.0f} TFLOP/s "
              f"(cuDNN {dense_ms:.1f} ms)", flush=True)
    results["dense_probe"] = rows


def cudnn_row(q, k, v, plan, layout, ratio, gran, dense_ms, dense_tflops) -> dict:
    """The cuDNN backend on `plan` beside the anchor (cuDNN-frontend's kernel alone on the same
    exact keys, Q/K/V packed beforehand) and the whole call on both GPU backends with the
    default tiling."""
    from ..kernels.cudnn_attention import _forward, block_sparse_cudnn, cudnn_calls, exact_attention_cudnn
    from ..kernels.tiled_pack import pack_qkv

    def anchor(plan: BlockSparsePlan) -> float:  # cuDNN's kernel alone on the plan's exact keys, Q/K/V packed
        packed = pack_qkv(q, k, v, plan.q_perm, plan.k_perm)
        calls = cudnn_calls(plan, packed[0], (0, q.shape[1]))
        block_len = plan.block_len.contiguous()
        return bench_ms(lambda: [_forward(qs, packed[1], packed[2], i, n, block_len) for _, qs, i, n in calls])

    exact, summary = computed_pairs(plan)
    bs = plan.block_size
    anchor_ms = anchor(plan)
    ms = bench_ms(lambda: block_sparse_cudnn(q, k, v, plan))
    part = exact_attention_cudnn(q, k, v, plan)
    row = dict(ratio=ratio, gran=gran, anchor_ms=anchor_ms, anchor_tflops=4 * DIM * exact / anchor_ms / 1e9,
               cudnn_backend_ms=ms, cudnn_backend_tflops=4 * DIM * (exact + summary) / ms / 1e9,
               pack_ms=bench_ms(lambda: pack_qkv(q, k, v, plan.q_perm, plan.k_perm)),
               exact_ms=bench_ms(lambda: exact_attention_cudnn(q, k, v, plan)),
               finish_ms=bench_ms(lambda: block_sparse_triton(q, q, q, plan, finish_config(DIM, bs, q.device), part)))
    part = None
    row["anchor_vs_dense_rate"] = row["anchor_tflops"] / dense_tflops
    default = build_plan(q, k, v, layout, SparseConfig(topk_ratio=ratio, tail_granularity=gran, backend="cudnn",
                                                       strict=True))  # reblock: full blocks, unlike cube's edges
    row["anchor_default_tiling_ms"] = anchor(default)
    row["anchor_default_tiling_vs_dense_rate"] = 4 * DIM * computed_pairs(default)[0] / row["anchor_default_tiling_ms"] \
        / 1e9 / dense_tflops
    default = None
    for backend in ("cudnn", "triton"):
        cfg = SparseConfig(topk_ratio=ratio, tail_granularity=gran, backend=backend, strict=True)
        row[f"op_default_{backend}_ms"] = bench_ms(lambda: sparse_attention(q, k, v, layout, cfg), rep_ms=1500)
        # planning as the op's share of device time: launches queued behind GPU work, as in a forward pass
        row[f"plan_default_{backend}_ms"], row[f"plan_default_{backend}_host_ms"] = queued_ms(
            lambda: build_plan(q, k, v, layout, cfg), q.device, warmup=1, reps=10)
        row[f"plan_share_{backend}"] = row[f"plan_default_{backend}_ms"] / row[f"op_default_{backend}_ms"]
    print(f"  cudnn r{ratio} {gran:5s}: anchor {anchor_ms:.2f} ms {row['anchor_tflops']:.0f} TFLOP/s "
          f"({100 * row['anchor_vs_dense_rate']:.0f}% of dense rate; default tiling "
          f"{row['anchor_default_tiling_ms']:.2f} ms, {100 * row['anchor_default_tiling_vs_dense_rate']:.0f}%); "
          f"backend {ms:.2f} ms (pack {row['pack_ms']:.2f}, "
          f"exact keys {row['exact_ms']:.2f}, tail and store {row['finish_ms']:.2f}); whole op default tiling "
          f"cudnn {row['op_default_cudnn_ms']:.1f} / triton {row['op_default_triton_ms']:.1f} ms "
          f"(plan {row['plan_default_cudnn_ms']:.1f} ms device, {100 * row['plan_share_cudnn']:.1f}% / "
          f"{100 * row['plan_share_triton']:.1f}%)", flush=True)
    return row


def timing(results: dict, shapes: list[str], ratios: list[float], block_sizes: list[int],
           variants: bool = True) -> None:
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
            plans = {bs: plan_for(q, k, v, layout, 0.1, block_size=bs)[0] for bs in (64, 128)}
            variants = {}
            for vname, (bs, conf) in VARIANTS.items():
                plan = plans[bs]
                try:
                    variants[vname] = kernel_row(q, k, v, plan, conf, dense_ms, dense_tflops)
                    print(f"  variant {vname}: {variants[vname]['kernel_ms']:.2f} ms "
                          f"{variants[vname]['tflops']:.0f} TFLOP/s", flush=True)
                except Exception as e:  # a variant that does not fit is reported, not fatal
                    variants[vname] = {"error": repr(e)[:300]}
                    print(f"  variant {vname}: {repr(e)[:200]}", flush=True)
            entry["variants_ratio_0.1"] = variants
            print("  compiled:", compiled_resources(), flush=True)
            del plans
            entry["planner_ms_ratio_0.1"] = planner_profile(q, k, v, layout, 0.1)
            print("  planner:", {n: round(t, 2) for n, t in entry["planner_ms_ratio_0.1"].items()}, flush=True)
        for bs in block_sizes:
            for ratio in ratios:
                for gran in ("query", "block"):
                    if gran == "block" and ratio != 0.1:
                        continue
                    plan, cfg = plan_for(q, k, v, layout, ratio, gran, bs)
                    for fam in FAMILIES:
                        conf = kernel_config(DIM, plan.block_size, q.device, family=fam)
                        row = dict(block_size=bs, ratio=ratio, gran=gran, family=fam,
                                   **kernel_row(q, k, v, plan, conf, dense_ms, dense_tflops))
                        if fam == FAMILIES[-1]:
                            row["sparse_attention_ms"] = bench_ms(lambda: sparse_attention(q, k, v, layout, cfg),
                                                                  rep_ms=1500)
                            row["sparse_attention_vs_dense"] = row["sparse_attention_ms"] / dense_ms
                        entry["rows"].append(row)
                        if bs == 64 and fam == FAMILIES[-1] and unavailable_reason("cudnn", q.device, q.dtype, DIM, bs) is None:
                            entry.setdefault("cudnn", []).append(
                                cudnn_row(q, k, v, plan, layout, ratio, gran, dense_ms, dense_tflops))
                        extra = (f" | whole op {row['sparse_attention_ms']:.1f} ms "
                                 f"({100 * row['sparse_attention_vs_dense']:.1f}% of dense)"
                                 ) if "sparse_attention_ms" in row else ""
                        print(f"  bs{bs} r{ratio} {gran:5s} {fam}: kernel {row['kernel_ms']:.2f} ms "
                              f"{row['tflops']:.0f} TFLOP/s ({100 * row['vs_dense_rate']:.0f}% of dense rate, "
                              f"{100 * row['vs_dense_time']:.1f}% of dense time)" + extra, flush=True)
        results["timing"][name] = entry
        q = k = v = plan = None  # free this shape's tensors before the next one
        torch.cuda.empty_cache()
    results["compiled"] = compiled_resources()


def markdown(results: dict) -> str:
    lines = [f"# Kernel check on {results['device']} ({results['versions']})", "",
             "| shape | block | ratio | tail | family | kernel ms | TFLOP/s (pairs computed) | % dense rate | "
             "% dense time | whole op ms | whole op % dense |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in results.get("timing", {}).items():
        lines.append(f"| {name} dense cuDNN | | | | | {e['dense_cudnn_ms']:.1f} | "
                     f"{e['dense_cudnn_tflops']:.0f} | 100 | 100 | | |")
        for r in e["rows"]:
            whole = (f"{r['sparse_attention_ms']:.1f} | {100 * r['sparse_attention_vs_dense']:.1f}"
                     if "sparse_attention_ms" in r else " | ")
            lines.append(f"| {name} | {r['block_size']} | {r['ratio']} | {r['gran']} | {r['family']} | "
                         f"{r['kernel_ms']:.2f} | {r['tflops']:.0f} | {100 * r['vs_dense_rate']:.0f} | "
                         f"{100 * r['vs_dense_time']:.1f} | {whole} |")
    cudnn = [(name, r) for name, e in results.get("timing", {}).items() for r in e.get("cudnn", [])]
    if cudnn:
        lines += ["", "| shape | ratio | tail | anchor ms | anchor TFLOP/s | anchor % dense rate | anchor on the default "
                  "tiling ms / % dense rate | cudnn backend ms | "
                  "whole op (default tiling) cudnn / triton ms | plan device ms | plan % of op cudnn / triton |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in cudnn:
            lines.append(f"| {name} | {r['ratio']} | {r['gran']} | {r['anchor_ms']:.2f} | {r['anchor_tflops']:.0f} | "
                         f"{100 * r['anchor_vs_dense_rate']:.0f} | {r['anchor_default_tiling_ms']:.2f} / "
                         f"{100 * r['anchor_default_tiling_vs_dense_rate']:.0f} | {r['cudnn_backend_ms']:.2f} | "
                         f"{r['op_default_cudnn_ms']:.1f} / {r['op_default_triton_ms']:.1f} | "
                         f"{r['plan_default_cudnn_ms']:.1f} | {100 * r['plan_share_cudnn']:.1f} / "
                         f"{100 * r['plan_share_triton']:.1f} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """Every section not in args.skip (options: `kernel-check` in bench/cli.py); writes
    kernel_check.json and kernel_check.md to args.out and prints the table.

    Args:
        args: out, quick, shapes, ratios, block_sizes, skip, and the hidden sanitize_child and
            profile_child flags (set when this tool runs itself under compute-sanitizer or ncu).
    Returns:
        0 (a failed check shows in the printed lines and the JSON, not in the status).
    """
    if args.sanitize_child:
        sanitize_child()
        return 0
    if args.profile_child:
        profile_child()
        return 0
    import triton

    results = {"device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
               "versions": f"torch {torch.__version__}, triton {triton.__version__}, nvidia-cudnn-frontend "
                           f"{environment(torch.device('cuda')).get('nvidia-cudnn-frontend', 'not installed')}",
               "date": time.strftime("%F %T"),
               "configs": {f"{f}/D{d}/bs{b}": c.__dict__ for (f, d, b), c in CONFIGS.items()}}
    skip = set(args.skip.split(","))
    start = time.time()
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    if "check" not in skip:
        for bs in block_sizes:
            correctness(results, args.quick, bs)
    if "sanitize" not in skip:
        sanitizer(results)
    if "ncu" not in skip:
        nsight(results)
    if "probe" not in skip:
        dense_probe(results)
    if "timing" not in skip:
        timing(results, args.shapes.split(","), [float(r) for r in args.ratios.split(",")], block_sizes,
               "variants" not in skip)
    results["wall_s"] = time.time() - start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernel_check.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    md = markdown(results)
    with open(os.path.join(args.out, "kernel_check.md"), "w") as f:
        f.write(md)
    print(md)
    return 0
