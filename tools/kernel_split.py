"""Where the op's time goes at the H3 shapes on the node's defaults: planning, the exact-key loop and
the query tail, gather against tiled mode, per-arch configs and summary-tile widths (CUDA).

Per shape and ratio (reblock tiling, reweight query tails, block size 64, bf16, 56 x 128):
the whole `sparse_attention` call (Triton; `auto`) and its planning share; the kernel on the
call's own plan, in gather and tiled mode, with and without its tail, so the exact loop's rate (exact pairs)
and the tail's (summary columns) are each measured against dense cuDNN SDPA's rate. Prints one
line per figure and writes JSON (--out).

    python tools/kernel_split.py --shapes 10s,5s --ratios 0.1,0.2 --out split.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from adaptive_sparse_attention.backend.attention import sparse_attention
from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.bench.scenes import h3_qkv
from adaptive_sparse_attention.bench.timing import bench_ms, queued_ms
from adaptive_sparse_attention.kernels.triton import attention as ta
from adaptive_sparse_attention.kernels.arch import KernelConfig, kernel_config
from kernel_cases import DIM, H3_SHAPES, HEADS, computed_pairs

# (arch, config changes) timed in tiled mode at 10s / 0.1: the small-shared-memory arch's own
# config (RTX 30/40/50), and summary tiles of 32 and 128 columns on sm90
VARIANTS = (("sm80", {}), ("sm90", {"block_t": 32}), ("sm90", {"block_t": 128}))


def whole_op(q, k, v, layout, cfg: SparseConfig) -> dict:
    """Median ms of the whole call and its planning share. Planning is device time with its launches
    queued behind GPU work, as inside a forward pass: a synchronised wall clock would also count the
    host's enqueue, which runs ahead of the GPU there."""
    ms = bench_ms(lambda: sparse_attention(q, k, v, layout, cfg), rep_ms=1500)
    plan_ms, host_ms = queued_ms(lambda: build_plan(q, k, v, layout, cfg), q.device, warmup=1, reps=10)
    return {"op_ms": ms, "plan_ms": plan_ms, "plan_host_ms": host_ms, "plan_share": plan_ms / ms}


def kernel_rates(q, k, v, plan, dense_tflops: float, tiled: bool, conf: KernelConfig | None = None) -> dict:
    """Kernel ms with and without the tail; the exact loop's and the tail's TFLOP/s."""
    exact, summary = computed_pairs(plan)
    bare = dataclasses.replace(plan, tail=None)
    full_ms = bench_ms(lambda: ta.block_sparse_triton(q, k, v, plan, conf, tiled=tiled))
    exact_ms = bench_ms(lambda: ta.block_sparse_triton(q, k, v, bare, conf, tiled=tiled))
    exact_tf = 4 * DIM * exact / exact_ms / 1e9
    tail_ms = max(full_ms - exact_ms, 1e-6)
    return {"kernel_ms": full_ms, "exact_ms": exact_ms, "tail_ms": tail_ms, "exact_tflops": exact_tf,
            "exact_vs_dense_rate": exact_tf / dense_tflops, "tail_tflops": 4 * DIM * summary / tail_ms / 1e9}


def main() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="10s,5s")
    parser.add_argument("--ratios", default="0.1,0.2")
    parser.add_argument("--out", default="kernel_split.json")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for name in args.shapes.split(","):
        layout = H3_SHAPES[name].layout()
        q, k, v = h3_qkv(layout, HEADS, DIM, torch.bfloat16, seed=7)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            dense_ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), rep_ms=2000)
        S = layout.total
        dense_tflops = 4 * DIM * HEADS * S * S / dense_ms / 1e9
        entry = results["shapes"][name] = {"S": S, "dense_cudnn_ms": dense_ms, "dense_tflops": dense_tflops, "rows": []}
        print(f"{name}: S {S} dense cuDNN {dense_ms:.1f} ms ({dense_tflops:.0f} TFLOP/s)", flush=True)
        for ratio in (float(r) for r in args.ratios.split(",")):
            cfg = SparseConfig(topk_ratio=ratio, kernel="triton", min_tokens=0)
            plan = build_plan(q, k, v, layout, cfg)
            op = whole_op(q, k, v, layout, cfg)
            print(f"  r{ratio} triton: op {op['op_ms']:.1f} ms (plan {op['plan_ms']:.1f}, "
                  f"{100 * op['plan_share']:.0f}%)", flush=True)
            for tiled in (False, True):
                row = {"ratio": ratio, "mode": "tiled" if tiled else "gather",
                       **(op if tiled else {}), **kernel_rates(q, k, v, plan, dense_tflops, tiled)}
                entry["rows"].append(row)
                print(f"  r{ratio} {row['mode']:6s}: kernel {row['kernel_ms']:.1f} = exact {row['exact_ms']:.1f} "
                      f"({row['exact_tflops']:.0f} TFLOP/s, {100 * row['exact_vs_dense_rate']:.0f}% of dense) + tail "
                      f"{row['tail_ms']:.1f} ({row['tail_tflops']:.0f} TFLOP/s)", flush=True)
            auto = bench_ms(lambda: sparse_attention(q, k, v, layout, dataclasses.replace(cfg, kernel="auto")))
            entry["rows"].append({"ratio": ratio, "mode": "auto", "op_ms": auto})
            print(f"  r{ratio} auto: op {auto:.1f} ms", flush=True)
            if name == "10s" and ratio == 0.1:
                for arch, changes in VARIANTS:
                    conf = dataclasses.replace(kernel_config(DIM, 64, q.device, arch=arch), **changes)
                    try:
                        row = {"ratio": ratio, "mode": "tiled", "arch": arch, "config": conf.__dict__,
                               **kernel_rates(q, k, v, plan, dense_tflops, True, conf)}
                    except Exception as e:  # a config that does not fit: reported, not fatal
                        row = {"arch": arch, "config": conf.__dict__, "error": repr(e)[:200]}
                    entry.setdefault("variants", []).append(row)
                    print(f"  variant {arch} {conf}: " + (row.get("error") or
                          f"kernel {row['kernel_ms']:.1f} exact {row['exact_ms']:.1f} "
                          f"({100 * row['exact_vs_dense_rate']:.0f}% of dense) tail {row['tail_ms']:.1f} "
                          f"({row['tail_tflops']:.0f} TFLOP/s)"), flush=True)
        q = k = v = None
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
