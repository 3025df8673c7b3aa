"""8-bit routing scores against the fp32 selection on the bench scenes (CPU or GPU).

    python -m adaptive_sparse_attention routing-quality [--size cpu-small] [--scenes pan,cuts]
        [--ratios 0.1,0.2] [--tiling reblock] [--rows 128] [--device auto] [--out FILE]

For every scene, ratio and 8-bit format (int8, fp8 e4m3), plans with `routing_scores` fp32 and
the format on the same tiling and compares, over the sparse query blocks of every (batch, head):
- overlap: the share of the fp32 picks the 8-bit routing also picks;
- mass kept: the attention mass of sampled target-video queries on the 8-bit picks over that on
  the fp32 picks (exact softmax over all keys; the context prefix, shared by both, left out), so
  1.0 means the cheap scores lose nothing (acceptance: at least 0.99);
- the fp32 routing's own recall (context included), for scale.
Prints a markdown table and writes JSON with the environment when --out is given.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from ..backend.config import SparseConfig
from .metrics import plan_mass_metrics, sample_rows
from ..backend.planner import build_plan, make_tiling
from .scenes import SIZES, STRUCTURED_SCENES, make_scene
from ..kernels.plan import BlockSparsePlan
from .runner import environment

FORMATS = ("int8", "fp8")


def pick_overlap(a: BlockSparsePlan, b: BlockSparsePlan) -> float:
    """Share of a's picks that b also picks, over the rows of sparse query blocks."""
    sparse = a.q2k_num > 0
    ai, bi = a.q2k_idx.contiguous(), b.q2k_idx.contiguous()  # rows ascending
    at = torch.gather(bi, -1, torch.searchsorted(bi, ai).clamp(max=bi.shape[-1] - 1))
    hits = (at == ai) & (ai >= 0)
    return float(hits.sum(-1)[sparse].double().sum() / a.q2k_num[sparse].double().sum())


def no_picks(plan: BlockSparsePlan) -> BlockSparsePlan:
    """The plan's dense prefix alone (every pick dropped): its recall is the context mass."""
    return dataclasses.replace(plan, q2k_num=torch.zeros_like(plan.q2k_num), tail=None)


def compare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, ratio: float, tiling_name: str,
            rows: torch.Tensor) -> list[dict]:
    """Result rows (one per 8-bit format) of one input at one ratio."""
    base = SparseConfig(topk_ratio=ratio, tiling=tiling_name, tail="none", min_tokens=0)
    tiling = make_tiling(q, k, layout, base)
    exact = build_plan(q, k, v, layout, base, tiling)
    recall, _ = plan_mass_metrics(q, k, exact, rows)
    context, _ = plan_mass_metrics(q, k, no_picks(exact), rows)
    picked = (recall - context).double().sum()
    out = []
    for fmt in FORMATS:
        cheap = build_plan(q, k, v, layout, base.replace(routing_scores=fmt), tiling)
        recall8, _ = plan_mass_metrics(q, k, cheap, rows)
        out.append({"scores": fmt, "overlap": pick_overlap(exact, cheap),
                    "mass_kept": float((recall8 - context).double().sum() / picked),
                    "fp32_recall": float(recall.mean()), "budget_R": int(exact.q2k_idx.shape[-1])})
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="cpu-small", choices=sorted(SIZES))
    parser.add_argument("--scenes", default=",".join(STRUCTURED_SCENES))
    parser.add_argument("--ratios", default="0.1,0.2")
    parser.add_argument("--tiling", default="reblock", choices=("reblock", "cube"))
    parser.add_argument("--rows", type=int, default=128, help="sampled target-video query rows")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")


def run(args: argparse.Namespace) -> int:
    """Every scene, ratio and format; prints the table and the verdict, writes JSON with the
    environment to args.out when given. Returns 0 when the worst mass kept passes, else 1."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = []
    for name in args.scenes.split(","):
        scene = make_scene(name, args.size, args.seed, device, dtype)
        rows = sample_rows(scene.layout, args.rows, args.seed)["video"]
        for ratio in (float(r) for r in args.ratios.split(",")):
            for row in compare(scene.q, scene.k, scene.v, scene.layout, ratio, args.tiling, rows):
                results.append({"scene": name, "ratio": ratio, **row})
                print(f"{name} r={ratio:g} {row['scores']}: overlap {row['overlap']:.4f} mass kept "
                      f"{row['mass_kept']:.4f}", file=sys.stderr, flush=True)
        del scene
    print("| scene | ratio | scores | overlap with fp32 picks | mass kept vs fp32 | fp32 recall |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['scene']} | {r['ratio']:g} | {r['scores']} | {r['overlap']:.4f} | {r['mass_kept']:.4f} | "
              f"{r['fp32_recall']:.4f} |")
    worst = min(r["mass_kept"] for r in results)
    print(f"\nworst mass kept: {worst:.4f} (acceptance: >= 0.99): {'PASS' if worst >= 0.99 else 'FAIL'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(device), "size": args.size, "tiling": args.tiling,
                       "rows": results}, f, indent=1)
    return 0 if worst >= 0.99 else 1
