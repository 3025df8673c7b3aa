"""The check of the sampled error estimate (backend/fidelity.py) against the true error of all video rows.

    python -m adaptive_sparse_attention error-estimate [--size h3-5s] [--heads 4] [--scenes pan,cuts,gaussian]
        [--ratios 0.1,0.2] [--rotations 1,6,16] [--strata 2] [--rows 64] [--tiling reblock] [--device auto]
        [--out FILE]

For every scene and ratio, one sparse call (measure_error off) and dense attention give the true error:
the relative L2 of the output over all target-video rows, per head and pooled over the heads. The
estimate is what a run accumulates: the sampled rows' per-head sums (`fidelity.sampled_error`) added up
over rotations 0..N-1, as a run's sparse steps add them (the scene held fixed, so what moves is only
which blocks are sampled), then sqrt(sum diff^2 / sum exact^2). Reported per N of `--rotations`:

- ratio: the pooled estimate over the pooled true error (acceptance: within 25%, 0.75-1.25);
- rank: Spearman's rank correlation of the per-head estimates with the per-head true errors
  (acceptance: at least 0.8);
and the sampled rows' share of the call's query rows (what the measurement costs, relative to dense).
Prints a markdown table; writes JSON with the environment when --out is given. Returns 1 when any
row at the largest N misses either acceptance bound.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from ..backend.attention import sparse_attention
from ..backend.config import SparseConfig
from ..backend.fidelity import ROWS, STRATA, sample_rows, sampled_error
from ..backend.layout import SequenceLayout
from .runner import bench_dtype, environment
from .scenes import SCENES, SIZES, make_scene, with_heads

RATIO_BOUND = 0.25  # |estimate / true - 1| at most this, for the run's mean
RANK_BOUND = 0.8  # Spearman rank correlation of the per-head errors at least this


def ranks(x: list[float]) -> list[float]:
    """1-based ranks of x, ties at their mean rank."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    out = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for m in range(i, j + 1):
            out[order[m]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of a and b (the Pearson correlation of their ranks; NaN when either
    is constant)."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else float("nan")


def true_errors(out: torch.Tensor, ref: torch.Tensor, layout: SequenceLayout) -> tuple[list[float], list[float]]:
    """Per head, (sum diff^2, sum ref^2) over all target-video rows and the batch, in float64."""
    rows = torch.arange(layout.target.start, layout.target.stop, device=out.device)
    diff, exact = [], []
    for h in range(out.shape[1]):  # one head at a time keeps the float64 copies small
        a, b = out[:, h].index_select(1, rows).double(), ref[:, h].index_select(1, rows).double()
        diff.append(float((a - b).pow(2).sum()))
        exact.append(float(b.pow(2).sum()))
    return diff, exact


def compare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, ref: torch.Tensor,
            layout: SequenceLayout, rotations: list[int], strata: int, rows: int) -> dict:
    """The true errors of `out` and the estimate after each count of `rotations` (ascending).

    Returns:
        {"true": pooled, "true_heads": [H], "estimates": {N: {"pooled", "heads", "ratio", "rank"}}}.
    """
    diff, exact = true_errors(out, ref, layout)
    true_heads = [math.sqrt(d / e) for d, e in zip(diff, exact)]
    true = math.sqrt(sum(diff) / sum(exact))
    sums = [torch.zeros(q.shape[1], dtype=torch.float64, device=q.device) for _ in range(2)]
    estimates, done = {}, 0
    for n in rotations:
        for rotation in range(done, n):
            sample = sampled_error(q, k, v, out, layout, rotation, "target-video", rows, strata)
            sums[0] += sample.sq_diff.double()
            sums[1] += sample.sq_exact.double()
        done = n
        heads = (sums[0] / sums[1]).sqrt().tolist()
        pooled = float((sums[0].sum() / sums[1].sum()).sqrt())
        estimates[n] = {"pooled": pooled, "heads": heads, "ratio": pooled / true,
                        "rank": spearman(heads, true_heads) if len(heads) > 1 else float("nan")}
    return {"true": true, "true_heads": true_heads, "estimates": estimates}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="h3-5s", choices=sorted(SIZES))
    parser.add_argument("--heads", type=int, default=4, help="the size's geometry with this many heads (1-8; 4: one "
                        "of each head kind, errors per head as at 56): H3 sizes on a CPU (default 4)")
    parser.add_argument("--scenes", default=",".join(SCENES))
    parser.add_argument("--ratios", default="0.1,0.2")
    parser.add_argument("--rotations", default="1,6,16",
                        help="rotations the estimate is accumulated over, as a run's sparse steps (default 1,6,16)")
    parser.add_argument("--strata", type=int, default=STRATA,
                        help=f"sampled blocks per head and call (default {STRATA})")
    parser.add_argument("--rows", type=int, default=ROWS, help=f"rows of a sampled block (default {ROWS})")
    parser.add_argument("--tiling", default="reblock", choices=("reblock", "cube"))
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")


def run(args: argparse.Namespace) -> int:
    """The table for every scene and ratio; JSON with the environment to args.out when given.
    Returns 0 when every row at the largest rotation count meets both acceptance bounds, else 1."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    size = with_heads(args.size, args.heads, "error-estimate")
    ratios = [float(r) for r in args.ratios.split(",")]
    rotations = sorted({int(n) for n in args.rotations.split(",")})
    if rotations[0] < 1:
        raise SystemExit(f"error-estimate: --rotations {args.rotations!r}: counts must be at least 1")
    results = []
    for name in args.scenes.split(","):
        s = make_scene(name, size, args.seed, device, bench_dtype(device))
        ref = torch.nn.functional.scaled_dot_product_attention(s.q, s.k, s.v)
        for r in ratios:
            config = SparseConfig(topk_ratio=r, tiling=args.tiling, min_tokens=0, kernel=args.kernel,
                                  measure_error=False)
            out = sparse_attention(s.q, s.k, s.v, s.layout, config)
            row = {"scene": name, "ratio": r, "head_kinds": list(s.head_kinds),
                   **compare(s.q, s.k, s.v, out, ref, s.layout, rotations, args.strata, args.rows)}
            last = row["estimates"][rotations[-1]]
            print(f"{name} r={r:g}: true {row['true']:.4f}, estimate {last['pooled']:.4f} after {rotations[-1]} "
                  f"rotations (ratio {last['ratio']:.3f}, rank {last['rank']:.2f})", file=sys.stderr, flush=True)
            results.append(row)
        del s, ref
    sampled = sample_rows(size.layout(), 1, 0, "target-video", "cpu", args.rows, args.strata).shape[1]
    print(render(results, args, rotations, sampled, size.total))
    ok = all(abs(r["estimates"][rotations[-1]]["ratio"] - 1) <= RATIO_BOUND
             and r["estimates"][rotations[-1]]["rank"] >= RANK_BOUND for r in results)
    print(f"\nat {rotations[-1]} rotations: estimate within {RATIO_BOUND:.0%} of the true error and head rank "
          f"correlation >= {RANK_BOUND} in every row: {'PASS' if ok else 'FAIL'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(device), "args": {k: v for k, v in vars(args).items() if k != "func"},
                       "sampled_rows_per_head": sampled, "results": results}, f, indent=1)
    return 0 if ok else 1


def render(results: list[dict], args: argparse.Namespace, rotations: list[int], sampled: int, total: int) -> str:
    """The markdown table: per scene and ratio the true error and, per rotation count, the estimate, its
    ratio to the true error and the head rank correlation; then the per-head errors at the largest count."""
    lines = [f"{args.size} with {args.heads} heads, tiling {args.tiling}: {sampled} sampled rows per head and call "
             f"({args.strata} x {args.rows}; {sampled / total:.2%} of the {total} query rows)", ""]
    head = "| scene | ratio | true err |" + "".join(f" est ({n}) | est/true ({n}) | rank ({n}) |" for n in rotations)
    lines += [head, "|---|---|---|" + "---|---|---|" * len(rotations)]
    for r in results:
        cells = "".join(f" {e['pooled']:.4f} | {e['ratio']:.3f} | {e['rank']:.2f} |"
                        for e in (r["estimates"][n] for n in rotations))
        lines.append(f"| {r['scene']} | {r['ratio']:g} | {r['true']:.4f} |{cells}")
    n = rotations[-1]
    lines += ["", f"Per head (true / estimate after {n} rotations):", "",
              "| scene | ratio | " + " | ".join(results[0]["head_kinds"]) + " |",
              "|---|---|" + "---|" * len(results[0]["head_kinds"])]
    for r in results:
        cells = " | ".join(f"{t:.4f} / {e:.4f}" for t, e in zip(r["true_heads"], r["estimates"][n]["heads"]))
        lines.append(f"| {r['scene']} | {r['ratio']:g} | {cells} |")
    return "\n".join(lines)
