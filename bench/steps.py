"""Denoising trajectories of the bench scenes: the warmup ramp's error per step, plans reused across steps.

    python -m adaptive_sparse_attention steps [--size cpu-small] [--heads 4] [--scenes pan,cuts] [--ratios 0.1,0.2]
        [--steps 8] [--shift 10] [--warmup-ratio 0.2] [--tiling reblock] [--drift-limits 0.08,0.05]
        [--rules sigma,steps] [--device auto] [--out FILE]

A trajectory is the scene at the flow sigmas of ComfyUI's "simple" schedule of `--steps` steps at
`--shift` (s_i = shift t / (1 + (shift - 1) t), t = 1 - i / steps; `bench/scenes.py`, "Denoising
drift", says how the scene moves with s). Every step is one op call on that step's Q/K/V, its output
compared with dense attention (relative L2 on the target-video rows). Two tables:

- warmup: per step, the density and error of `fidelity` (dense warmup, then topk_ratio) beside
  `ramp` (`nodes/schedule.ramp_ratio` with the model's warmup and start sigmas, 1.0 for flow);
- plan reuse: over the sparse steps (sigma at or below the warmup sigma), the error of a fresh plan
  at every step beside the plan the node's rule keeps (`backend/plan_reuse.py`, one slot as one block
  of one branch has), their worst per-step ratio (acceptance: at most 1.05), the rebuilds, the drift
  the check measured at each reused step, and the planner time of both (host clock around the planner
  with the device synchronised; on the CPU the torch reference's time); one row per prediction rule
  and drift limit (`--rules`, `--drift-limits`: each its own slot beside the same fresh plans).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ..backend.attention import sparse_attention
from ..backend.config import SparseConfig
from ..backend.plan_reuse import DRIFT_LIMIT, PlanStore
from ..nodes.schedule import ramp_ratio, warmup_reason
from .metrics import output_errors
from .runner import bench_dtype, environment
from .scenes import SIZES, STRUCTURED_SCENES, make_scene, with_heads

REUSE_BOUND = 1.05  # reused-plan error over fresh-plan error, per step, at equal density


def flow_sigma(shift: float, t: float) -> float:
    """ComfyUI's flow sigma at time t with `shift` (``time_snr_shift``)."""
    return shift * t / (1.0 + (shift - 1.0) * t)


def simple_sigmas(steps: int, shift: float) -> list[float]:
    """The `steps` sigmas a "simple" schedule evaluates (the final 0 left out)."""
    return [flow_sigma(shift, 1.0 - i / steps) for i in range(steps)]


def video_error(out: torch.Tensor, ref: torch.Tensor, layout) -> float:
    """Relative L2 of out against dense on the target-video rows."""
    return output_errors(out, ref, layout)["video"]["rel_l2"]


def timed_call(q, k, v, layout, config: SparseConfig, slot=None) -> tuple[torch.Tensor, float]:
    """(output, planner ms) of one call."""
    out, info = sparse_attention(q, k, v, layout, config, return_info=True, timings=True, plan_slot=slot)
    return out, info.timings_ms["plan"]


def warmup_row(q, k, v, layout, ref, step: int, sigma: float, config: SparseConfig, threshold: float,
               known: dict[float, float] | None = None) -> dict:
    """One step: fidelity's and ramp's (density, error) (a dense step: density 1, error 0). `known`:
    errors already measured on this step at a density (a fresh plan's), not computed again; both
    modes at one density share one call."""
    row, errors = {"step": step, "sigma": sigma}, dict(known or {})
    for mode in ("fidelity", "ramp"):
        mode_config = config.replace(warmup_mode=mode)
        if warmup_reason(mode_config, sigma, threshold, None, 1.0) is not None:
            row[mode] = (1.0, 0.0)
            continue
        ratio = ramp_ratio(mode_config, sigma, threshold, 1.0, None)
        if ratio not in errors:
            errors[ratio] = video_error(sparse_attention(q, k, v, layout, mode_config.replace(topk_ratio=ratio)),
                                        ref, layout)
        row[mode] = (ratio, errors[ratio])
    return row


def reuse_row(q, k, v, layout, ref, step: int, sigma: float, next_sigma: float, config: SparseConfig,
              slots: dict) -> dict:
    """One sparse step: a fresh plan's error and planner ms, and for each slot ((rule, drift limit) ->
    slot) the error and planner ms of its plan and the drift its check measured (None where it planned
    afresh). Rule "sigma" gives the slot the step's sigmas, "steps" none (gaps count steps)."""
    fresh, fresh_ms = timed_call(q, k, v, layout, config)
    row = {"step": step, "sigma": sigma, "fresh": video_error(fresh, ref, layout), "fresh_ms": fresh_ms, "limits": {}}
    for limit, slot in slots.items():
        slot.at(*((sigma, next_sigma) if limit[0] == "sigma" else (None, None)))
        before = slot.kept
        kept, kept_ms = timed_call(q, k, v, layout, config, slot)
        reused = before is not None and slot.kept is before  # a fresh plan replaces the kept one
        row["limits"][limit] = {"reused": video_error(kept, ref, layout), "ms": kept_ms,
                                "drift": float(slot.kept.last_drift) if reused else None}
    return row


def reuse_rows(scene_at, sigmas: list[tuple[int, float]], config: SparseConfig, limit: float = DRIFT_LIMIT,
               rule: str = "sigma") -> tuple[list[dict], dict]:
    """`reuse_row` over (step, sigma) pairs of a schedule ending at sigma 0, with one slot (`rule`, drift
    limit `limit`; `scene_at(sigma)` -> q, k, v, layout, dense output); rows flattened to fresh/reused
    errors; also the store's counts."""
    store = PlanStore(drift_limit=limit)
    slot = store.slot("block")
    rows = []
    for i, (step, sigma) in enumerate(sigmas):
        q, k, v, layout, ref = scene_at(sigma)
        if not rows:  # the layout's caches are built before anything is timed
            sparse_attention(q, k, v, layout, config)
        next_sigma = sigmas[i + 1][1] if i + 1 < len(sigmas) else 0.0
        row = reuse_row(q, k, v, layout, ref, step, sigma, next_sigma, config, {(rule, limit): slot})
        rows.append({**row, "reused": row["limits"][(rule, limit)]["reused"]})
    return rows, store.summary()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="cpu-small", choices=sorted(SIZES))
    parser.add_argument("--heads", type=int, help="the size's geometry with this many heads (1-8; 4: one of each "
                        "head kind, errors per head as at 56): H3 sizes on a CPU")
    parser.add_argument("--scenes", default=",".join(STRUCTURED_SCENES))
    parser.add_argument("--ratios", default="0.1,0.2")
    parser.add_argument("--steps", type=int, default=8, help="steps of the simple schedule (default 8)")
    parser.add_argument("--shift", type=float, default=10.0, help="flow shift (default 10, H3's video shift)")
    parser.add_argument("--warmup-ratio", type=float, default=0.2)
    parser.add_argument("--tiling", default="reblock", choices=("reblock", "cube"))
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--drift-limits", default=str(DRIFT_LIMIT),
                        help=f"plan reuse's drift limits to compare, comma-separated (default {DRIFT_LIMIT}, the node's)")
    parser.add_argument("--rules", default="sigma",
                        help="plan reuse's prediction rules to compare: sigma (the node's: the drift per unit of "
                             "sigma over the schedule's next gap), steps (gaps counted in steps), comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")


def run(args: argparse.Namespace) -> int:
    """Both tables for every scene and ratio; writes JSON with the environment to args.out when given.
    Returns 0 when every scene's worst reused/fresh ratio is within REUSE_BOUND, else 1."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = bench_dtype(device)
    sigmas = simple_sigmas(args.steps, args.shift)
    threshold = flow_sigma(args.shift, 1.0 - args.warmup_ratio) if 0 < args.warmup_ratio < 1 else (
        1.0 if args.warmup_ratio <= 0 else 0.0)
    ratios = [float(r) for r in args.ratios.split(",")]
    size = with_heads(args.size, args.heads, "steps")
    unknown = [r for r in args.rules.split(",") if r not in ("sigma", "steps")]
    if unknown:
        raise SystemExit(f"steps: --rules {args.rules!r}: {unknown} not allowed; expected sigma and/or steps")
    limits = [(rule, float(x)) for rule in args.rules.split(",") for x in args.drift_limits.split(",")]
    results, worst = [], {limit: 0.0 for limit in limits}
    for name in args.scenes.split(","):
        configs = {r: SparseConfig(topk_ratio=r, tiling=args.tiling, min_tokens=0, kernel=args.kernel,
                                   warmup_ratio=args.warmup_ratio) for r in ratios}
        slots = {r: {x: PlanStore(drift_limit=x[1]).slot("block") for x in limits} for r in ratios}
        rows = {r: {"scene": name, "ratio": r, "warmup": [], "reuse": []} for r in ratios}
        for step, sigma in enumerate(sigmas):  # one step's scene at a time
            s = make_scene(name, size, args.seed, device, dtype, noise=min(1.0, sigma))
            ref = torch.nn.functional.scaled_dot_product_attention(s.q, s.k, s.v)
            for r in ratios:
                known = {}
                if sigma <= threshold * (1 + 1e-4):  # a sparse step of the run
                    if not rows[r]["reuse"]:  # the layout's caches are built before anything is timed
                        sparse_attention(s.q, s.k, s.v, s.layout, configs[r])
                    next_sigma = sigmas[step + 1] if step + 1 < len(sigmas) else 0.0
                    rows[r]["reuse"].append(reuse_row(s.q, s.k, s.v, s.layout, ref, step, sigma, next_sigma,
                                                      configs[r], slots[r]))
                    known = {r: rows[r]["reuse"][-1]["fresh"]}
                rows[r]["warmup"].append(warmup_row(s.q, s.k, s.v, s.layout, ref, step, sigma, configs[r], threshold,
                                                    known))
            del s, ref
        for r in ratios:
            reuse = rows[r]["reuse"]
            rows[r]["limits"] = {}
            for x in limits:
                step_ratios = [row["limits"][x]["reused"] / row["fresh"] for row in reuse]
                worst[x] = max([worst[x]] + step_ratios)
                rows[r]["limits"][x] = {"plans": slots[r][x].store.summary(),
                                        "worst_reuse_ratio": max(step_ratios, default=None)}
                print(f"{name} r={r:g} {x[0]} limit {x[1]:g}: worst reused/fresh {max(step_ratios, default=float('nan')):.4f}, "
                      f"{rows[r]['limits'][x]['plans']}", file=sys.stderr, flush=True)
            results.append(rows[r])
    print(render(results, args, threshold, limits))
    ok = [x for x in limits if worst[x] <= REUSE_BOUND]
    for x in limits:
        print(f"\n{x[0]} rule, drift limit {x[1]:g}: worst reused/fresh error over every sparse step {worst[x]:.4f} "
              f"(acceptance <= {REUSE_BOUND}): {'PASS' if x in ok else 'FAIL'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(device), "args": {k: v for k, v in vars(args).items() if k != "func"},
                       "drift_limit": DRIFT_LIMIT, "worst": [[*x, w] for x, w in worst.items()],
                       "results": jsonable(results)}, f, indent=1)
    return 0 if len(ok) == len(limits) else 1


def jsonable(results: list[dict]) -> list[dict]:
    """`results` with the (rule, limit) keys written as "rule limit"."""
    out = []
    for r in results:
        reuse = [{**x, "limits": {f"{a} {b:g}": y for (a, b), y in x["limits"].items()}} for x in r["reuse"]]
        out.append({**r, "reuse": reuse, "limits": {f"{a} {b:g}": y for (a, b), y in r["limits"].items()}})
    return out


def render(results: list[dict], args: argparse.Namespace, threshold: float, limits: list[tuple[str, float]]) -> str:
    """The two markdown tables (the reuse table: one row per scene, ratio, rule and drift limit)."""
    heads = "" if args.heads is None else f" with {args.heads} head" + "s" * (args.heads != 1)
    lines = [f"{args.size}{heads}, {args.steps} steps, shift {args.shift:g}, warmup_ratio {args.warmup_ratio:g} "
             f"(warmup sigma {threshold:.4f}), tiling {args.tiling}", "",
             "| scene | ratio | step | sigma | fidelity density | fidelity err | ramp density | ramp err |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for w in r["warmup"]:
            lines.append(f"| {r['scene']} | {r['ratio']:g} | {w['step']} | {w['sigma']:.4f} | {w['fidelity'][0]:.3f} | "
                         f"{w['fidelity'][1]:.4f} | {w['ramp'][0]:.3f} | {w['ramp'][1]:.4f} |")
    lines += ["", "| scene | ratio | rule | drift limit | sparse steps | fresh err (mean) | reused err (mean) | "
              "worst reused/fresh | plans built (rebuilds) | reused | planner ms fresh | planner ms reused | saved | "
              "drift at the reused steps |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows, n = r["reuse"], max(1, len(r["reuse"]))
        fresh_ms = sum(x["fresh_ms"] for x in rows)
        for limit in limits:
            kept = [x["limits"][limit] for x in rows]
            kept_ms = sum(x["ms"] for x in kept)
            p, worst = r["limits"][limit]["plans"], r["limits"][limit]["worst_reuse_ratio"]
            drifts = ", ".join(f"{x['step']}: {x['limits'][limit]['drift']:.3f}" for x in rows
                               if x["limits"][limit]["drift"] is not None)
            lines.append(f"| {r['scene']} | {r['ratio']:g} | {limit[0]} | {limit[1]:g} | {len(rows)} | "
                         f"{sum(x['fresh'] for x in rows) / n:.4f} | {sum(x['reused'] for x in kept) / n:.4f} | "
                         f"{worst or float('nan'):.4f} | {p['built']} ({p['rebuilds']}) | {p['reused']} | "
                         f"{fresh_ms / n:.1f} | {kept_ms / n:.1f} | "
                         f"{(1 - kept_ms / fresh_ms) * 100 if fresh_ms else 0:.0f}% | {drifts or '-'} |")
    return "\n".join(lines)
