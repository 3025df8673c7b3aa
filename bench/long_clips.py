"""Long clips on the GPU: planner memory and time, kernel time, dense cuDNN where it fits.

    python -m adaptive_sparse_attention bench-long [--shapes 10s,30s,60s] [--ratio 0.1]
        [--tilings reblock,cube] [--no-dense] [--out FILE]

Per H3 shape (56 heads x 128, bf16; q, k, v are views of one buffer, as H3's fused projection
makes them; random values, so the numbers are about time and memory, not quality):
1. Routing alone on one tiling's block means: the streamed `route_blocks` with fp32, int8 and
   fp8 scores, and the full-matrix path before streaming `select_blocks(pooled_scores(...))` where its
   [B, H, J, J] scores fit: ms, peak extra memory, and whether the fp32 selections are identical
   (the GPU check of bit-identical selection) and how many picks the 8-bit scores share with it.
2. `build_plan` per tiling (default config otherwise): ms and the allocator's peak above what
   was held before the call, also as a share of Q/K/V's bytes (target: at most 10%); the first
   call of a shape also builds cached tables (and reblock's CUDA graph): its peak and what the
   caches keep afterwards are reported apart.
3. The kernel alone on that plan and the whole `sparse_attention` call: ms.
4. Dense cuDNN SDPA: ms (skipped with --no-dense, or reported as the error it raised).
Times are device milliseconds with the launches queued behind GPU work, as inside a model's
forward pass where the host runs ahead (`timing.queued_ms`); `host_ms` is the host's enqueue
time beside them. Prints a markdown table per part and writes JSON with the environment when
--out is given.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ..backend.attention import sparse_attention
from ..backend.config import SparseConfig
from ..backend.planner import build_plan, make_tiling
from ..backend.pooling import block_means
from ..backend.routing import pooled_scores, route_blocks, route_plan, select_blocks
from ..kernels.registry import resolve
from ..kernels.plan import group_span
from .methods import dense_call
from .runner import environment
from .scenes import SIZES, h3_qkv
from .timing import queued_ms

SHAPES = ("10s", "30s", "60s")


def peak_extra_mb(fn) -> tuple[object, float]:
    """(fn(), the allocator's peak during the call above what was allocated before, MiB)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def ms(fn, reps: int = 5) -> tuple[float, float]:
    """(median device milliseconds of fn with its launches queued behind GPU work, as inside a
    model's forward pass, the longest host enqueue time seen); `timing.queued_ms`."""
    return queued_ms(fn, torch.device("cuda"), warmup=1, reps=reps)


def shared_picks(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of the picks of index table a [..., R] (ascending, -1 rows) that b also holds."""
    at = torch.gather(b, -1, torch.searchsorted(b.contiguous(), a.contiguous()).clamp(max=b.shape[-1] - 1))
    live = a >= 0
    return float(((at == a) & live).sum() / live.sum().clamp(min=1))


def routing_rows(q, k, layout, config: SparseConfig, shape: str) -> list[dict]:
    kernels = resolve(config.kernel, q.device, q.dtype)
    tiling = make_tiling(q, k, layout, config, kernels)
    q_mean, k_mean = block_means(q, tiling.q_perm, tiling, kernels), block_means(k, tiling.k_perm, tiling, kernels)
    dense_hi, groups = route_plan(tiling, config.sparse_scope, config.topk_ratio)
    rows, picks = [], {}
    for scores in ("fp32", "int8", "fp8"):
        def streamed():  # as the planner calls it
            return route_blocks(q_mean, k_mean, dense_hi, groups, scores, kernels, group_span(groups))

        (idx, _), peak = peak_extra_mb(streamed)
        picks[scores] = idx
        row = {"shape": shape, "tiling": config.tiling, "routing": f"streamed {scores}", "J": tiling.num_blocks,
               "peak_mib": peak, "shared_picks_vs_fp32": shared_picks(picks["fp32"], idx)}
        row["ms"], row["host_ms"] = ms(streamed, reps=20)
        rows.append(row)
    full = lambda: select_blocks(pooled_scores(q_mean, k_mean, kernels=kernels), dense_hi, groups, kernels)  # noqa: E731
    row = {"shape": shape, "tiling": config.tiling, "routing": "full matrix (before streaming)",
           "J": tiling.num_blocks}
    try:
        (idx, _), row["peak_mib"] = peak_extra_mb(full)
        row["ms"], row["host_ms"] = ms(full, reps=20)
        row["identical_to_streamed_fp32"] = bool(torch.equal(idx, picks["fp32"]))
        del idx
    except torch.cuda.OutOfMemoryError as e:
        row["error"] = f"OutOfMemoryError: {str(e).splitlines()[0]}"
    rows.append(row)
    return rows


def plan_rows(q, k, v, layout, config: SparseConfig, shape: str, qkv_mib: float) -> dict:
    before = torch.cuda.memory_allocated()
    _, first = peak_extra_mb(lambda: build_plan(q, k, v, layout, config))  # builds the cached tables
    cached = (torch.cuda.memory_allocated() - before) / 2 ** 20  # what the caches keep (CUDA graph, tables)
    plan, peak = peak_extra_mb(lambda: build_plan(q, k, v, layout, config))
    row = {"shape": shape, "tiling": config.tiling, "S": layout.total, "J": plan.num_blocks,
           "R": int(plan.q2k_idx.shape[-1]), "qkv_mib": qkv_mib, "plan_peak_mib": peak,
           "plan_peak_share_of_qkv": peak / qkv_mib, "first_plan_peak_mib": first, "cached_mib": cached}
    row["plan_ms"], row["plan_host_ms"] = ms(lambda: build_plan(q, k, v, layout, config))
    row["kernel_ms"], _ = ms(lambda: resolve("triton", q.device, q.dtype).attention.attend_blocks(q, k, v, plan))
    row["call_ms"], row["call_host_ms"] = ms(lambda: sparse_attention(q, k, v, layout, config))
    return row


def dense_row(q, k, v, shape: str) -> dict:
    row = {"shape": shape}
    try:
        call, name = dense_call(q, k, v)
        row.update(backend=name, ms=ms(call, reps=2)[0])
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return row


def table(rows: list[dict], keys: list[str]) -> str:
    def cell(x):
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(key, "")) for key in keys) + " |" for r in rows]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated of 5s, 10s, 14s, 30s, 60s (default 10s,30s,60s)")
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--tilings", default="reblock,cube")
    parser.add_argument("--no-dense", action="store_true", help="skip dense cuDNN")
    parser.add_argument("--out", help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    """Measure every shape; prints the tables, writes JSON to args.out when given."""
    if not torch.cuda.is_available():
        print("bench-long needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {"environment": environment(torch.device("cuda")), "ratio": args.ratio,
              "routing": [], "plans": [], "dense": []}
    for shape in args.shapes.split(","):
        size = SIZES[f"h3-{shape}"]
        layout = size.layout()
        q, k, v = h3_qkv(layout, size.heads, size.head_dim, torch.bfloat16, seed=11)
        qkv_mib = 3 * q.numel() * q.element_size() / 2 ** 20
        for tiling in args.tilings.split(","):
            config = SparseConfig(topk_ratio=args.ratio, tiling=tiling, min_tokens=0, kernel="triton")
            result["plans"].append(plan_rows(q, k, v, layout, config, shape, qkv_mib))  # first: fresh caches
            print(json.dumps(result["plans"][-1]), file=sys.stderr, flush=True)
            result["routing"] += routing_rows(q, k, layout, config, shape)
        if not args.no_dense:
            result["dense"].append(dense_row(q, k, v, shape))
        del q, k, v
        torch.cuda.empty_cache()
    env = result["environment"]
    print(f"{env['hardware']}, torch {env['torch']}, triton {env.get('triton')}, {env['date']}\n`{env['command']}`\n")
    print(table(result["plans"], ["shape", "tiling", "S", "J", "R", "plan_ms", "plan_host_ms", "kernel_ms", "call_ms",
                                  "plan_peak_mib", "plan_peak_share_of_qkv", "first_plan_peak_mib", "cached_mib",
                                  "qkv_mib"]) + "\n")
    print(table(result["routing"], ["shape", "tiling", "routing", "J", "ms", "host_ms", "peak_mib",
                                    "shared_picks_vs_fp32", "identical_to_streamed_fp32", "error"]) + "\n")
    if result["dense"]:
        print(table(result["dense"], ["shape", "backend", "ms", "error"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
