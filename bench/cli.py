"""Command line: `python -m adaptive_sparse_attention COMMAND`, one subcommand per benchmark or check.

- demo: the main job on a fresh machine: a small synthetic H3-like scene, dense vs sparse at a
  few ratios and tail modes, one table (density, attention-mass recall, relative L2 error vs
  dense, time). Uses the GPU when CUDA is available; about a minute on a 2-core CPU.
- bench: a preset (cpu-small, h3-5s, h3-10s, h3-14s, h3-30s, h3-60s) x methods x ratios; writes a markdown
  table, JSON and plots to --out and prints the table (--heads: an H3 preset's geometry with a few heads,
  which the CPU can run).
- evaluate: the same metrics on a capture file written by the "Capture H3 Attention" node.
- prepare: compile the kernels and measure the dense-kernel choice for this GPU ahead of the first
  sampler run (bench/prepare.py; install.py runs it too).
- e2e: the whole KSampler run in real ComfyUI (COMFYUI_PATH) with and without our node
  (bench/e2e.py).
- bench-long: long clips (30 s, 60 s) on the GPU: planner memory and time, kernel time, dense
  cuDNN where it fits (bench/long_clips.py).
- routing-quality: 8-bit routing scores against the fp32 selection (bench/routing_quality.py).
- steps: denoising trajectories of the scenes: the warmup ramp's error per step beside dense warmup,
  and plans reused across steps beside fresh ones (bench/steps.py).
- frontier: the speed-up against `topk_ratio` and the measured error, one line per clip, drawn from the
  JSON `e2e` writes (bench/frontier.py; needs matplotlib).
- error-estimate: the sampled error estimate of a sparse call (backend/fidelity.py) against the true
  error of all video rows on the scenes: its ratio and the head ranking (bench/error_estimate.py).
- GPU timings of one part, each in its own module of this folder: planner-timing, reblock-timing,
  tiling-ceiling (recall of many tilings; also on the CPU), ulysses-timing (sequence parallel, one
  process per rank under torchrun).

Each command's module exposes `add_arguments(parser)` and `run(args)`. The developer tools for
kernel work (correctness and timing sweeps of the Triton kernel, compute-sanitizer, Nsight
Compute, the reblock device check, ahead-of-time compiles) are scripts in the repository's
tools/ folder, not commands of the installed package.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from typing import Any

import torch

from ..kernels import registry
from ..nodes.capture import capture_header, load_capture
from . import (error_estimate, frontier, long_clips, planner_timing, prepare, reblock_timing, routing_quality,
               steps, tiling_ceiling, ulysses_timing)
from .checkpoints import WEIGHTS
from .e2e import RUNS
from .e2e_graphs import ATTENTION_BACKENDS, DEFAULT_PRESET
from .e2e_graphs import PRESETS as E2E_PRESETS
from .methods import DEFAULT_METHOD, sol_unavailable_reason, split_spec
from .report import RECALL_BOUND, column_notes, markdown_table, render_markdown, verdicts, write_outputs
from .runner import PRESETS, Case, resolve_kernel, run_cases, run_preset

BENCH_METHODS = ["dense", "ours:reblock:reweight:query", "ours:reblock:mean:query", "ours:reblock:none:query",
                 "ours:reblock:reweight:block", "ours:cube:reweight:query", "ours:cube:none:query",
                 "sol:topk", "sol:tau=1.0", "flex:reblock", "dense:fa4", "dense:ck-int8", "dense:sage"]
EVALUATE_METHODS = ["dense", DEFAULT_METHOD, "ours:reblock:mean:query", "ours:cube:none:query", "sol:topk"]


def _shifts(text: str) -> tuple[float, float]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected VIDEO,AUDIO shifts, got {text!r}") from None
    if len(values) != 2 or not all(0.01 <= x <= 100.0 for x in values):
        raise argparse.ArgumentTypeError(f"expected two shifts in [0.01, 100] (VIDEO,AUDIO), got {text!r}")
    return values


def _widget(text: str) -> tuple[str, Any]:
    """NAME=VALUE of a sparse-node widget: VALUE as JSON where it is a number or a flag, else the text."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a widget of the sparse node), got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return name.strip(), value if isinstance(value, (bool, int, float)) else raw


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0.01 <= x <= 1.0 for x in values):
        raise argparse.ArgumentTypeError(f"ratios must be in [0.01, 1], got {text!r}")
    return values


def _device(text: str) -> torch.device:
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(text)


def demo_methods() -> list[str]:
    return ["dense"] + [f"ours:reblock:{tail}:query" for tail in ("reweight", "mean", "none")] + ["ours:cube:reweight:query"]


def cmd_demo(args: argparse.Namespace) -> int:
    device = _device(args.device)
    preset = PRESETS["demo"]
    backend = resolve_kernel(args.kernel, device)
    off_gpu = "" if device.type == "cuda" else f" (sparse rows on the {backend} backend: see the note under the table)"
    print(f"demo: synthetic H3-like scene (text + audio + a moving-object video grid) on {device}{off_gpu}",
          file=sys.stderr)
    from .runner import scene_cases
    from .scenes import SIZES

    rows = run_cases(scene_cases(SIZES[preset.size], preset.scenes, args.seed, device), 1, demo_methods(), args.ratios,
                     device, backend, preset.rows_per_group, preset.warmup, preset.reps, args.seed)
    print(markdown_table(rows))
    print("\n" + column_notes())
    if device.type != "cuda":
        print(demo_timing_note(backend))
    return 1 if any("error" in r for r in rows) else 0


def demo_timing_note(backend: str) -> str:
    """What the demo's times mean off the GPU: the quality columns hold, the times are no speed claim.

    Args:
        backend: the kernel backend the sparse rows ran on.
    Returns:
        The note printed under the table.
    """
    kernel = ("the pure-torch reference kernel (the correctness oracle)" if backend == "torch"
              else f"the {backend} kernels outside a GPU (Triton's interpreter)")
    return "\n" + textwrap.fill(
        f"Without a CUDA GPU the sparse rows run {kernel}, each timed once without warm-up, against dense "
        "attention on torch's own optimised kernel. Their `ms`, `plan ms` and `vs dense` columns are therefore no "
        "speed claim (`plan ms` is timed in separate cold runs and can exceed `ms`); density, recall and the "
        "errors hold. Speed-ups are measured on a CUDA GPU with the Triton kernel: see the README, \"Expected speed-up "
        "by clip length\".", 100)


def cmd_bench(args: argparse.Namespace) -> int:
    device = _device(args.device)
    methods = args.methods.split(",") if args.methods else BENCH_METHODS
    scenes = args.scenes.split(",") if args.scenes else None
    code = 0
    for preset in args.preset:
        deadline = time.monotonic() + args.budget_s if args.budget_s else None
        result = run_preset(preset, methods, args.ratios, device, args.kernel, args.seed, scenes, deadline,
                            args.heads)
        paths = write_outputs(result, args.out, lambda s: print(s, file=sys.stderr))
        print(render_markdown(result))
        print("wrote " + ", ".join(paths), file=sys.stderr)
        code |= 1 if any("error" in r for r in result["rows"]) else 0
    return code


def evaluate_file(path: str, methods: list[str], ratios: list[float], device: torch.device, backend: str = "auto",
                  rows_per_group: int = 128, seed: int = 0) -> list[dict]:
    """Result rows of every method on every entry of a capture file (cases named L<layer>s<step>)."""
    entries, layout, meta = load_capture(path)
    print(f"{path}: {len(entries)} entries, {layout!r}, meta {meta}", file=sys.stderr)
    dtype = None if device.type == "cuda" else torch.float32  # the CPU computes in fp32 anyway
    cases = (Case(f"L{e['layer']}s{e['step']}", *(e[n].to(device, dtype or e[n].dtype) for n in "qkv"), layout)
             for e in entries)
    return run_cases(cases, len(entries), methods, ratios, device, resolve_kernel(backend, device),
                     rows_per_group, warmup=1, reps=3, seed=seed)


def capture_problem(path: str) -> str | None:
    """Why `path` cannot be evaluated (missing, unreadable, not a capture file), in one line, or None."""
    made_by = 'expected a file written by the "Capture H3 Attention" node (in ComfyUI\'s output folder)'
    if not os.path.exists(path):
        return f"evaluate: {path}: no such file; {made_by}"
    if not os.path.isfile(path):
        return f"evaluate: {path} is not a file; {made_by}"
    try:
        capture_header(path)
    except (OSError, ValueError) as err:
        return f"evaluate: {' '.join(str(err).split())}; {made_by}"
    return None


def cmd_evaluate(args: argparse.Namespace) -> int:
    problem = capture_problem(args.file)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    methods = args.methods.split(",") if args.methods else EVALUATE_METHODS
    rows = evaluate_file(args.file, methods, args.ratios, _device(args.device), args.kernel, args.rows, args.seed)
    print(markdown_table(rows))
    print("\n" + column_notes())
    sol_asked = any(split_spec(m)[0] == "sol:topk" for m in methods)
    print("\nVerdicts (acceptance bound: the node's defaults at topk_ratio 0.1 keep at least "
          f"{RECALL_BOUND:.0%} of the attention mass, and a lower rel L2 than sol_attn at top-k 0.2 where it runs):")
    for line in verdicts(rows, sol_unavailable_reason() if sol_asked else None):
        print(line)
    return 1 if any("error" in r for r in rows) else 0


def cmd_e2e(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .checkpoints import unsupported
    from .e2e import (default_work, markdown, preset_line, qkv_markdown, run_benchmark, saving_markdown,
                      split_markdown)

    if not args.comfyui or not os.path.isfile(os.path.join(args.comfyui, "main.py")):
        print(f"e2e: --comfyui (or COMFYUI_PATH) must point at a ComfyUI checkout, got {args.comfyui!r}",
              file=sys.stderr)
        return 2
    if args.compile_only and args.compile is None:
        print("e2e: --compile-only needs --compile BACKEND", file=sys.stderr)
        return 2
    weights = args.weights or E2E_PRESETS[args.preset].weights
    refused = unsupported(weights, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if refused:
        print(f"e2e: {refused}", file=sys.stderr)
        return 2
    work = Path(args.work) if args.work else default_work()
    out = Path(args.out) if args.out else work / "e2e.json"
    result = run_benchmark(args.comfyui, work, args.scale, args.blocks, args.steps, args.cfg, args.clips.split(","),
                           out, lambda s: print(s, file=sys.stderr), compile_backend=args.compile,
                           compile_only=args.compile_only, runs=tuple(args.runs.split(",")), prepared=args.prepared,
                           profile_call=args.profile_call, weights=weights, launch=args.launch,
                           precision=args.precision, preset=args.preset, sigma_shift=args.sigma_shift,
                           attention_backend=args.attention_backend, widgets=dict(args.set or ()),
                           vram_gib=args.vram_gib, dynamic_vram=not args.disable_dynamic_vram)
    print(preset_line(result))
    widgets = "".join(f", {k}={v}" for k, v in result["widgets"].items())
    print(f"ComfyUI launched as {result['launch']} (its attention: {result['comfyui_attention']}); our node at "
          f"precision {result['precision']}{widgets}; every ratio is against this launch without our node")
    print(markdown(result))
    print()
    print(saving_markdown(result))
    print()
    print(qkv_markdown(result))
    if result["op"]:
        print()
        print(split_markdown(result))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m adaptive_sparse_attention",
                                     description="Adaptive block-sparse attention for MiniMax-H3: demo, benchmarks, evaluation, GPU timings.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, ratios: str) -> None:
        p.add_argument("--ratios", type=_floats, default=_floats(ratios), help=f"top-k ratios (default {ratios})")
        p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda[:N]")
        p.add_argument("--kernel", "--backend", dest="kernel", default="auto", choices=("auto", *registry.FAMILIES),
                       help="kernel family of ours (SparseConfig.kernel; --backend is its old name): auto = the "
                            "first that runs of cuDNN-frontend (optional package, sm90), "
                            "Triton on CUDA, else the torch reference")
        p.add_argument("--seed", type=int, default=0)

    demo = sub.add_parser("demo", help="small synthetic scene: dense vs sparse at a few ratios and tail modes")
    common(demo, "0.1,0.2,0.3")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmark presets; writes markdown, JSON and plots")
    bench.add_argument("--preset", nargs="+", default=["cpu-small"], choices=[p for p in PRESETS if p != "demo"])
    bench.add_argument("--methods", help="comma-separated method specs, each optionally with its own ratios as "
                       "spec@0.1/0.2 (default: " + ",".join(BENCH_METHODS) + ")")
    bench.add_argument("--scenes", help="comma-separated scenes (pan, cuts, gaussian; default per preset)")
    bench.add_argument("--out", default="bench_out", help="output folder (default bench_out)")
    bench.add_argument("--heads", type=int, help="the preset's geometry with this many heads (1-8; 4: one of each "
                       "head kind): H3-size presets then run on the CPU too, errors per head as at 56 heads")
    bench.add_argument("--budget-s", type=float, help="per preset: stop starting new runs after this many seconds (results so far are written)")
    common(bench, "0.1,0.2,0.3")
    bench.set_defaults(func=cmd_bench)

    ev = sub.add_parser("evaluate", help="quality metrics on a capture file (safetensors from the capture node)")
    ev.add_argument("file")
    ev.add_argument("--methods", help="comma-separated method specs (default: " + ",".join(EVALUATE_METHODS) + ")")
    ev.add_argument("--rows", type=int, default=128, help="sampled query rows per row group (default 128)")
    common(ev, "0.1,0.2")
    ev.set_defaults(func=cmd_evaluate)

    e2e = sub.add_parser("e2e", help="the whole KSampler run in real ComfyUI with and without our node")
    e2e.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH", ""),
                     help="ComfyUI checkout (default: COMFYUI_PATH)")
    e2e.add_argument("--scale", default="h3", choices=("h3", "tiny"),
                     help="h3: full-width MiniMax-H3 at 1344x768 (GPU); tiny: a tiny model (CPU check)")
    e2e.add_argument("--blocks", type=int, default=6, help="DiT blocks of the random model (H3 has 50)")
    e2e.add_argument("--preset", default=DEFAULT_PRESET, choices=tuple(E2E_PRESETS),
                     help="the sampler setup: ksampler-19-cfg3 (KSampler euler, cfg 3), or the official H3 t2v "
                          "template's (SamplerCustomAdvanced, BasicGuider cfg 1, res_multistep, simple): t2v-20, "
                          "turbo-8 and turbo-4 (a Turbo LoRA on an int8_convrot checkpoint)")
    e2e.add_argument("--steps", type=int, help="sampling steps (default: the preset's)")
    e2e.add_argument("--cfg", type=float, help="KSampler's cfg (default: the preset's; template presets: 1)")
    e2e.add_argument("--sigma-shift", type=_shifts, metavar="VIDEO,AUDIO",
                     help="add MiniMaxH3SigmaShift to every graph (the FastH3 template sets 10,3; the t2v template "
                          "has none: the model's own 12/3)")
    e2e.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                     help="add ModelAttentionBackend to every graph, with and without our node (the FastH3 template "
                          "sets 'comfy kitchen attention')")
    e2e.add_argument("--clips", default="10s,5s", help="clips, the first is the main one (5s, 10s, 30s at 1344x768; "
                                                       "0.4mp-2s: 864x480 56 frames, 0.9mp-5s: 1280x736 124 frames)")
    e2e.add_argument("--work", help="folder for the model, caches and output (default: a new temporary one)")
    e2e.add_argument("--out", help="JSON results (default: WORK/e2e.json)")
    e2e.add_argument("--compile", choices=("inductor", "cudagraphs", "eager"),
                     help="also run the main clip through ComfyUI's TorchCompileModel node with this backend, with "
                          "and without our node (eager: dynamo only, for CPU checks)")
    e2e.add_argument("--compile-only", action="store_true",
                     help="with --compile: only the compiled runs and ComfyUI / ours uncompiled on the main clip")
    e2e.add_argument("--runs", default=",".join(RUNS),
                     help="comma-separated runs (default all): " + ", ".join(RUNS) + "; comfyui always runs")
    e2e.add_argument("--prepared", action="store_true",
                     help="first run the pack's prepare command in a child process (empty caches otherwise); the "
                          "first run of ours is then the first use after it (ours-prepared)")
    e2e.add_argument("--weights", choices=WEIGHTS,
                     help="checkpoint format (default: the preset's: bf16 for ksampler-19-cfg3, int8_convrot for the "
                          "template presets): bf16, or the DiT block Linear weights quantised with ComfyUI's own "
                          "functions (int8_convrot, fp8: sm89+, nvfp4: sm100+; refused where the GPU lacks them)")
    e2e.add_argument("--launch", default="default", choices=("default", "ck", "sage"),
                     help="ComfyUI as launched plainly, with --use-ck-attention (comfy-kitchen INT8) or with "
                          "--use-sage-attention (sageattention package); every ratio is against the same launch")
    e2e.add_argument("--precision", default="auto", choices=("auto", "bf16", "8-bit"),
                     help="our node's precision widget in every run of ours (default auto: follows the launch)")
    e2e.add_argument("--set", action="append", type=_widget, metavar="NAME=VALUE",
                     help="a widget of our node in every run of ours, e.g. --set plan_reuse=on --set topk_ratio=0.1 "
                          "(repeatable; the runs that set a widget themselves, such as ours-ratio-0.1, keep theirs)")
    e2e.add_argument("--vram-gib", type=float, metavar="N",
                     help="ComfyUI sees a card of N GiB (its reserve, dynamic VRAM and partial loading decide as on "
                          "one) and torch's allocator is capped at N GiB; N below the GPU's memory")
    e2e.add_argument("--disable-dynamic-vram", action="store_true",
                     help="ComfyUI's --disable-dynamic-vram: estimate-based loading instead of comfy-aimdo's dynamic "
                          "VRAM, which the e2e otherwise starts as ComfyUI's main.py does")
    e2e.add_argument("--profile-call", type=int, metavar="N",
                     help="profile the N-th model call (0-based) of every run: kernel tables in WORK/profiles/RUN.txt")
    e2e.set_defaults(func=cmd_e2e)

    prep = sub.add_parser("prepare", help="compile the kernels and measure the dense kernel for this GPU, ahead of "
                                          "the first run", description=prepare.__doc__.splitlines()[0])
    prepare.add_arguments(prep)
    prep.set_defaults(func=prepare.run)

    long = sub.add_parser("bench-long", help="long clips on the GPU: planner memory and time, kernel, dense cuDNN")
    long_clips.add_arguments(long)
    long.set_defaults(func=long_clips.run)

    for name, module, text in (
            ("planner-timing", planner_timing, "GPU: each planner step with and without the fused Triton kernels"),
            ("reblock-timing", reblock_timing, "GPU: the reblock tiling, its stages and the plan against the kernel"),
            ("tiling-ceiling", tiling_ceiling, "recall of many tilings per head, the best per head, where recall is lost"),
            ("ulysses-timing", ulysses_timing, "sequence-parallel attention, one rank per process: run under torchrun"),
            ("routing-quality", routing_quality, "8-bit routing scores against the fp32 selection on the bench scenes"),
            ("steps", steps, "denoising trajectories: the warmup ramp's error per step, plans reused across steps"),
            ("error-estimate", error_estimate, "the sampled error estimate against the true error of all video rows"),
            ("frontier", frontier, "speed-up against ratio and measured error from e2e JSON, as a PNG")):
        p = sub.add_parser(name, help=text, description=module.__doc__.splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
