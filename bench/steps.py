"""Denoising trajectories of the bench scenes: the warmup ramp's error per step, plans reused across steps, the
error target's ratio per step.

    python -m adaptive_sparse_attention steps [--size cpu-small] [--heads 4] [--scenes pan,cuts] [--ratios 0.1,0.2]
        [--steps 8] [--shift 10] [--warmup-ratio 0.2] [--tiling reblock] [--drift-limits 0.08,0.05]
        [--rules sigma,steps] [--tables warmup,reuse,target] [--targets default,0.5x,2x] [--device auto] [--out FILE]

A trajectory is the scene at the flow sigmas of ComfyUI's "simple" schedule of `--steps` steps at
`--shift` (s_i = shift t / (1 + (shift - 1) t), t = 1 - i / steps; `bench/scenes.py`, "Denoising
drift", says how the scene moves with s; the `gaussian` control has no content to noise and is the same at
every step). Every step is one op call on that step's Q/K/V, its output compared with dense attention
(relative L2 on the target-video rows). Three tables (`--tables` picks):

- warmup: per step, the density and error of `fidelity` (dense warmup, then topk_ratio) beside
  `ramp` (`nodes/schedule.ramp_ratio` with the model's warmup and start sigmas, 1.0 for flow);
- plan reuse: over the sparse steps (sigma at or below the warmup sigma), the error of a fresh plan
  at every step beside the plan the node's rule keeps (`backend/plan_reuse.py`, one slot as one block
  of one branch has), their worst per-step ratio (acceptance: at most 1.05), the rebuilds, the drift
  the check measured at each reused step, and the planner time of both (host clock around the planner
  with the device synchronised; on the CPU the torch reference's time); one row per prediction rule
  and drift limit (`--rules`, `--drift-limits`: each its own slot beside the same fresh plans);
- error target: over the sparse steps, the run at the fixed ratio beside runs whose ratio the node's error
  target sets (`nodes/error_target.ErrorTarget` reading a `nodes/error_meter.ErrorMeter`, one block, the
  sampled rows' sink and ``error_rotation`` = step as `nodes/sparse_call.attend` passes them to block 0; the
  first sparse step at the ratio). The target is the fixed run's own measured error (the mean of its sampled
  rows over the trajectory, as the node's report gives it: "default", today's ratio's error) or a multiple of
  it ("0.5x", "2x"), or an absolute error ("0.08"), per `--targets`. Per scene, ratio and rule: the ratio of
  every step, the mean density (`plan.density()`), the true video-row error of every step against dense and
  its mean, the sampled estimate of every step (what the target reads) and of the run, the final ratio, the
  first sparse step (from 1) from which every step's true error is within the target's band (`BAND`), the
  ratios a run went back to after leaving them, and the op's milliseconds per step (plan, kernel and sampled
  rows, the device synchronised between them; on a CPU the torch reference's time, not a speed figure). A call
  at a step and ratio already made by another run of the table is not made again (same inputs, ratio and
  rotation: the same output and sampled rows): its row, op ms included, is reused.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from ..backend.attention import sparse_attention
from ..backend.config import SparseConfig
from ..backend.plan_reuse import DRIFT_LIMIT, PlanStore
from ..nodes.error_meter import ErrorMeter
from ..nodes.error_target import BAND, ErrorTarget
from ..nodes.schedule import ramp_ratio, warmup_reason
from .metrics import output_errors
from .runner import bench_dtype, environment
from .scenes import SIZES, STRUCTURED_SCENES, make_scene, with_heads

REUSE_BOUND = 1.05  # reused-plan error over fresh-plan error, per step, at equal density
TABLES = ("warmup", "reuse", "target")
TARGET_BLOCK = 0  # the block index the error-target runs stand for (its rotation is step + block, as the node's)


def flow_sigma(shift: float, t: float) -> float:
    """ComfyUI's flow sigma at time t with `shift` (``time_snr_shift``)."""
    return shift * t / (1.0 + (shift - 1.0) * t)


def simple_sigmas(steps: int, shift: float) -> list[float]:
    """The `steps` sigmas a "simple" schedule evaluates (the final 0 left out)."""
    return [flow_sigma(shift, 1.0 - i / steps) for i in range(steps)]


def scene_noise(name: str, sigma: float) -> float:
    """The scene's noise at a step of flow sigma `sigma`: sigma (at most 1), 0 for the `gaussian` control (i.i.d.
    inputs with no content to noise: the same scene at every step)."""
    return 0.0 if name == "gaussian" else min(1.0, sigma)


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


def parse_targets(text: str) -> list[tuple[str, float | None, float | None]]:
    """`--targets` as (name, multiple of the fixed run's error or None, absolute error or None): "default" (1x),
    "<f>x" (f times it), or a plain number (that error)."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            if item == "default":
                out.append((item, 1.0, None))
            elif item.endswith("x"):
                out.append((item, float(item[:-1]), None))
            else:
                out.append((item, None, float(item)))
        except ValueError:
            raise SystemExit(f"steps: --targets {text!r}: {item!r} not allowed; expected default, a multiple such as "
                             "0.5x, or an error such as 0.08") from None
        value = out[-1][2] if out[-1][1] is None else out[-1][1]
        if not math.isfinite(value) or value <= 0:
            raise SystemExit(f"steps: --targets {text!r}: {item!r} not allowed; expected a positive target")
    return out


def op_call(q, k, v, layout, config: SparseConfig, step: int, meter: ErrorMeter) -> tuple[torch.Tensor, object, float]:
    """One sparse call of block TARGET_BLOCK at `step` as the node makes it (its sampled rows added to `meter` with
    its ratio, rotation step + block): (output, info, op ms: plan, kernel and sampled rows, the device
    synchronised)."""
    sink = meter.sink(step, TARGET_BLOCK, 0, q.shape[1], config.topk_ratio)
    out, info = sparse_attention(q, k, v, layout, config, return_info=True, timings=True,
                                 error_rotation=step + TARGET_BLOCK, error_sink=sink)
    return out, info, sum(info.timings_ms.values())


def target_run(trajectory: list[tuple], config: SparseConfig, target: float | None,
               warmed: set[float] | None = None, made: dict | None = None) -> dict:
    """One run of block TARGET_BLOCK over the sparse steps `trajectory` ((step, sigma, q, k, v, layout, dense
    output) each): at `config.topk_ratio` throughout (target None), or at the ratio `ErrorTarget` gives from the
    errors `ErrorMeter` measured at the steps before (its first step at topk_ratio). On CUDA a ratio not in
    `warmed` (which it joins) runs once untimed first, so no timed call prepares kernels. `made`: the calls
    already made, (step, ratio) -> their row and sampled sums; such a call is not made again (the same inputs,
    ratio and rotation give the same output), its row (op ms included) and sums are reused.

    Returns:
        {"target", "steps", "ratios", "densities", "errors" (true, all video rows vs dense), "sampled" (each
        step's sampled estimate), "ms", "sampled_mean" (the meter's run mean, the node's report's number)}.
    """
    meter, chooser = ErrorMeter(), ErrorTarget()
    made = {} if made is None else made
    run = {"target": target, "steps": [], "ratios": [], "densities": [], "errors": [], "sampled": [], "ms": []}
    for step, sigma, q, k, v, layout, ref in trajectory:
        ratio = config.topk_ratio if target is None else chooser.ratio(meter, TARGET_BLOCK, step, target,
                                                                       config.topk_ratio)
        if (step, ratio) not in made:
            call_config = config if ratio == config.topk_ratio else config.replace(topk_ratio=ratio)
            if q.is_cuda and warmed is not None and ratio not in warmed:
                sparse_attention(q, k, v, layout, call_config)
                warmed.add(ratio)
            own = ErrorMeter()
            out, info, ms = op_call(q, k, v, layout, call_config, step, own)
            made[(step, ratio)] = ({"densities": float(info.density), "errors": video_error(out, ref, layout),
                                    "sampled": info.sampled_error, "ms": ms}, own.sums[(step, TARGET_BLOCK)])
            del out, info
        row, sums = made[(step, ratio)]
        meter.sink(step, TARGET_BLOCK, 0, sums.shape[1], ratio)(sums[0], sums[1])
        run["steps"].append(step)
        run["ratios"].append(ratio)
        for key, value in row.items():
            run[key].append(value)
    summary = meter.summary()
    run["sampled_mean"] = None if summary is None else summary["mean"]
    return run


def target_runs(trajectory: list[tuple], config: SparseConfig, targets: list[tuple[str, float | None, float | None]]
                ) -> dict:
    """The fixed run at `config.topk_ratio` and one `target_run` per `--targets` item, the targets set from the
    fixed run's sampled mean error (the calls made once per step and ratio). The layout's caches are built by
    one untimed call first."""
    if not trajectory:
        return {"fixed": None, "targets": {}}
    _, _, q, k, v, layout, _ = trajectory[0]
    sparse_attention(q, k, v, layout, config)  # the layout's caches are built before anything is timed
    warmed, made = {config.topk_ratio}, {}
    fixed = target_run(trajectory, config, None, warmed, made)
    runs = {}
    for name, multiple, absolute in targets:
        target = absolute if multiple is None else multiple * fixed["sampled_mean"]
        runs[name] = target_run(trajectory, config, target, warmed, made)
    return {"fixed": fixed, "targets": runs}


def settled(run: dict) -> tuple[int | None, list[float]]:
    """(the first sparse step, counted from 1, from which every step's true error is within the band of the
    run's target, None where the last is not; the ratios the run went back to after leaving them)."""
    inside = [abs(e / run["target"] - 1.0) <= BAND for e in run["errors"]]
    first = next((i for i in range(len(inside)) if all(inside[i:])), None)
    visited, back = [], []
    for r in run["ratios"]:
        if visited and r == visited[-1]:
            continue
        (back if r in visited else visited).append(r)
    return None if first is None else first + 1, back


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
    parser.add_argument("--tables", default=",".join(TABLES),
                        help="which tables to make, comma-separated: warmup, reuse, target (default all three)")
    parser.add_argument("--targets", default="default",
                        help="the error-target table's targets, comma-separated: default (the fixed ratio's own "
                             "measured mean error), a multiple of it (0.5x, 2x) or an error (0.08); default: default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")


def run(args: argparse.Namespace) -> int:
    """The tables of `--tables` for every scene and ratio; writes JSON with the environment to args.out when
    given. The error-target runs keep every sparse step's Q/K/V and dense output of one scene on the device
    (about 2 GB a step at h3-5s with 56 heads in bf16). Returns 0 when every scene's worst reused/fresh ratio
    is within REUSE_BOUND (or the reuse table is not made), else 1."""
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
    tables = [t.strip() for t in args.tables.split(",") if t.strip()]
    if not tables or any(t not in TABLES for t in tables):
        raise SystemExit(f"steps: --tables {args.tables!r} not allowed; expected some of {', '.join(TABLES)}")
    targets = parse_targets(args.targets)
    results, worst = [], {limit: 0.0 for limit in limits}
    for name in args.scenes.split(","):
        configs = {r: SparseConfig(topk_ratio=r, tiling=args.tiling, min_tokens=0, kernel=args.kernel,
                                   warmup_ratio=args.warmup_ratio) for r in ratios}
        slots = {r: {x: PlanStore(drift_limit=x[1]).slot("block") for x in limits} for r in ratios}
        rows = {r: {"scene": name, "ratio": r, "warmup": [], "reuse": []} for r in ratios}
        trajectory = []  # the sparse steps' inputs and dense outputs, for the error-target runs
        for step, sigma in enumerate(sigmas):  # one step's scene at a time
            sparse = sigma <= threshold * (1 + 1e-4)  # a sparse step of the run
            if "warmup" not in tables and not sparse:
                continue
            s = make_scene(name, size, args.seed, device, dtype, noise=scene_noise(name, sigma))
            ref = torch.nn.functional.scaled_dot_product_attention(s.q, s.k, s.v)
            for r in ratios:
                known = {}
                if sparse and "reuse" in tables:
                    if not rows[r]["reuse"]:  # the layout's caches are built before anything is timed
                        sparse_attention(s.q, s.k, s.v, s.layout, configs[r])
                    next_sigma = sigmas[step + 1] if step + 1 < len(sigmas) else 0.0
                    rows[r]["reuse"].append(reuse_row(s.q, s.k, s.v, s.layout, ref, step, sigma, next_sigma,
                                                      configs[r], slots[r]))
                    known = {r: rows[r]["reuse"][-1]["fresh"]}
                if "warmup" in tables:
                    rows[r]["warmup"].append(warmup_row(s.q, s.k, s.v, s.layout, ref, step, sigma, configs[r],
                                                        threshold, known))
            if sparse and "target" in tables:
                trajectory.append((step, sigma, s.q, s.k, s.v, s.layout, ref))
            del s, ref
        for r in ratios:
            if "target" in tables:
                rows[r]["target"] = target_runs(trajectory, configs[r], targets)
                for label, x in [(f"fixed {r:g}", rows[r]["target"]["fixed"]), *rows[r]["target"]["targets"].items()]:
                    if x is not None:
                        print(f"{name} r={r:g} error target {label}: ratios {x['ratios']}, true errors "
                              f"{[round(e, 4) for e in x['errors']]}, sampled mean {x['sampled_mean']:.4f}",
                              file=sys.stderr, flush=True)
        del trajectory
        for r in ratios:
            if "reuse" not in tables:
                results.append(rows[r])
                continue
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
    print(render(results, args, threshold, limits, tables))
    if "reuse" not in tables:
        limits = []
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
        out.append({**r, "reuse": reuse, "limits": {f"{a} {b:g}": y for (a, b), y in r.get("limits", {}).items()}})
    return out


def render(results: list[dict], args: argparse.Namespace, threshold: float, limits: list[tuple[str, float]],
           tables: tuple[str, ...] | list[str] = TABLES) -> str:
    """The markdown tables of `tables` (the reuse table: one row per scene, ratio, rule and drift limit; the
    error-target table: one row per scene, ratio and rule)."""
    heads = "" if args.heads is None else f" with {args.heads} head" + "s" * (args.heads != 1)
    lines = [f"{args.size}{heads}, {args.steps} steps, shift {args.shift:g}, warmup_ratio {args.warmup_ratio:g} "
             f"(warmup sigma {threshold:.4f}), tiling {args.tiling}"]
    if "warmup" in tables:
        lines += ["", "| scene | ratio | step | sigma | fidelity density | fidelity err | ramp density | ramp err |",
                  "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for w in r["warmup"]:
            lines.append(f"| {r['scene']} | {r['ratio']:g} | {w['step']} | {w['sigma']:.4f} | {w['fidelity'][0]:.3f} | "
                         f"{w['fidelity'][1]:.4f} | {w['ramp'][0]:.3f} | {w['ramp'][1]:.4f} |")
    if "reuse" in tables:
        lines += ["", *render_reuse(results, limits)]
    if "target" in tables:
        lines += ["", *render_target(results)]
    return "\n".join(lines)


def render_reuse(results: list[dict], limits: list[tuple[str, float]]) -> list[str]:
    """The plan-reuse table's lines."""
    lines = ["| scene | ratio | rule | drift limit | sparse steps | fresh err (mean) | reused err (mean) | "
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
    return lines


def render_target(results: list[dict]) -> list[str]:
    """The error-target table's lines: per scene and ratio the fixed run, then one row per target."""
    lines = ["| scene | ratio | rule | target err | sparse steps | ratio per step | density (mean) | "
             "true err per step | true err (mean) | sampled err per step | sampled err (run) | final ratio | "
             "in band from step | ratios gone back to | op ms per step | op ms (mean) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def listed(xs: list[float], fmt: str) -> str:
        return ", ".join(format(x, fmt) for x in xs)

    for r in results:
        runs = r.get("target")
        if not runs or runs["fixed"] is None:
            continue
        for rule, x in [(f"fixed {r['ratio']:g}", runs["fixed"]), *((f"target {k}", y) for k, y in
                                                                   runs["targets"].items())]:
            n = len(x["steps"])
            first, back = settled(x) if x["target"] is not None else (None, [])
            band = "-" if x["target"] is None else "never" if first is None else str(first)
            lines.append(f"| {r['scene']} | {r['ratio']:g} | {rule} | "
                         f"{'-' if x['target'] is None else format(x['target'], '.4f')} | {n} | "
                         f"{listed(x['ratios'], '.3f')} | {sum(x['densities']) / n:.3f} | "
                         f"{listed(x['errors'], '.4f')} | {sum(x['errors']) / n:.4f} | "
                         f"{listed(x['sampled'], '.4f')} | {x['sampled_mean']:.4f} | {x['ratios'][-1]:.3f} | "
                         f"{band} | {listed(back, '.3f') or 'none'} | {listed(x['ms'], '.0f')} | {sum(x['ms']) / n:.1f} |")
    return lines
