"""Where a fresh plan's time goes at the H3 shapes on the node's defaults (CUDA): per stage, and per kernel.

Per shape (56 heads x 128, bf16, `SparseConfig(topk_ratio=ratio)`: reblock tiling, reweight query tails,
block size 64, the Triton kernels): `build_plan` whole, and each stage it runs on its own, in the order it runs
them (the metric features, the tree partition and the per-head tube choice of the reblock tiling, the block
means of Q and K, the routing's scores and TopK, the tail summaries), each as device time with its launches
queued behind GPU work (`queued_ms`: as inside a forward pass, where the host runs ahead) and as the host's
enqueue time; then one `build_plan` under the profiler: its kernel launches and the kernels that take the
most device time. Prints one line per figure and writes JSON (--out).

    python tools/planner_split.py --shapes 5s,10s --out planner.json
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.backend.head_choice import choose_tubes
from adaptive_sparse_attention.backend.planner import build_plan, call_kernels, routing_scores
from adaptive_sparse_attention.backend.pooling import block_means
from adaptive_sparse_attention.backend.reblock import reblock_tiling
from adaptive_sparse_attention.backend.reblock_graphs import run_partition
from adaptive_sparse_attention.backend.reblock_metric import metric_features
from adaptive_sparse_attention.backend.reblock_schedule import Schedule, cached_static
from adaptive_sparse_attention.backend.routing import route_blocks, route_plan
from adaptive_sparse_attention.backend.tail import reweight_summaries, target_anchor
from adaptive_sparse_attention.bench.scenes import h3_qkv
from adaptive_sparse_attention.bench.timing import queued_ms
from adaptive_sparse_attention.kernels.plan import group_span
from kernel_cases import H3_SHAPES


def stages(q, k, v, layout, cfg: SparseConfig) -> dict:
    """name -> callable of each stage of a fresh plan, on inputs the earlier stages made (computed once here)."""
    kernels = call_kernels(q, layout, cfg)
    B, H, _, D = q.shape
    static = cached_static(layout, cfg.block_size, q.device)
    video = [(seg, part) for seg, part in zip(layout.regions(), static.parts) if isinstance(part, Schedule)]
    sliced = [(seg, part, q[:, :, seg.start:seg.stop].reshape(B * H, seg.length, D),
               k[:, :, seg.start:seg.stop].reshape(B * H, seg.length, D)) for seg, part in video]
    feats = [metric_features(ks, qs, kernels, layout.cache) for _, _, qs, ks in sliced]
    tiling = reblock_tiling(q, k, layout, cfg.block_size, cfg.reblock_layout, cfg.topk_ratio, tubes=False,
                            kernels=kernels)
    perm = tiling.q_perm.unsqueeze(0)
    tiled = reblock_tiling(q, k, layout, cfg.block_size, cfg.reblock_layout, cfg.topk_ratio, kernels=kernels)
    q_mean = block_means(q, tiled.q_perm, tiled, kernels)
    k_mean = block_means(k, tiled.k_perm, tiled, kernels)
    dense_hi, groups = route_plan(tiled, cfg.sparse_scope, cfg.topk_ratio, layout.cache)
    fmt = routing_scores(cfg, q.device, layout.cache.notices)
    anchor = target_anchor(q_mean, tiled)
    return {
        "metric features": lambda: [metric_features(ks, qs, kernels, layout.cache) for _, _, qs, ks in sliced],
        "tree partition": lambda: [run_partition(z, part, cfg.block_size, kernels, layout.cache, seg.start)
                                   for z, (seg, part, _, _) in zip(feats, sliced)],
        "tube choice": lambda: choose_tubes(q, k, perm, layout, cfg.block_size, static.region_blocks[-1],
                                            cfg.topk_ratio, kernels),
        "reblock tiling (the three above)": lambda: reblock_tiling(q, k, layout, cfg.block_size, cfg.reblock_layout,
                                                                   cfg.topk_ratio, kernels=kernels),
        "block means q, k": lambda: (block_means(q, tiled.q_perm, tiled, kernels),
                                     block_means(k, tiled.k_perm, tiled, kernels)),
        "routing (scores, TopK)": lambda: route_blocks(q_mean, k_mean, dense_hi, groups, fmt, kernels,
                                                       group_span(groups)),
        "tail summaries": lambda: reweight_summaries(k, v, tiled, anchor, kernels),
        "build_plan": lambda: build_plan(q, k, v, layout, cfg),
    }


def profile(fn, reps: int = 3) -> dict:
    """Kernel launches of one call and the kernels with the most device time (per call), under the profiler."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.name:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = sorted(((n, c / reps, us / reps / 1e3) for n, (c, us) in per.items()), key=lambda r: -r[2])
    return {"launches": sum(r[1] for r in rows), "device_ms": sum(r[2] for r in rows),
            "top": [{"kernel": n[:120], "per_call": c, "ms": ms} for n, c, ms in rows[:25]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="5s,10s")
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "ratio": a.ratio, "shapes": {}}
    for shape in a.shapes.split(","):
        size = H3_SHAPES[shape]
        layout = size.layout()
        q, k, v = h3_qkv(layout, size.heads, size.head_dim, torch.bfloat16, seed=0)
        cfg = SparseConfig(topk_ratio=a.ratio, strict=True)
        row = {"S": layout.total, "stages": {}}
        for name, fn in stages(q, k, v, layout, cfg).items():
            ms, host = queued_ms(fn, q.device, warmup=2, reps=7)
            row["stages"][name] = {"queued_ms": ms, "host_ms": host}
            print(f"{shape} {name}: {ms:.2f} ms queued, host enqueue {host:.2f} ms", flush=True)
        row["profile"] = profile(lambda: build_plan(q, k, v, layout, cfg))
        p = row["profile"]
        print(f"{shape} build_plan under the profiler: {p['launches']:.0f} launches, {p['device_ms']:.2f} ms of kernels")
        for r in p["top"]:
            print(f"    {r['ms']:7.3f} ms  x{r['per_call']:5.1f}  {r['kernel']}")
        res["shapes"][shape] = row
        del q, k, v
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
