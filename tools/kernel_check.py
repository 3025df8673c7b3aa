"""GPU check and timing of the fused Triton kernel, one call on a CUDA machine (a developer tool).

    python tools/kernel_check.py --out DIR [--quick] [--skip SECTIONS]

Sections, in order (each in its own file of this folder):
  check     correctness against the float64 reference (kernel_correctness.py)
  sanitize  compute-sanitizer memcheck of a small case (nvidia_tools.py)
  ncu       Nsight Compute sections of one launch (nvidia_tools.py)
  probe     the kernel with every block exact against cuDNN (dense_probe.py)
  timing    kernel and whole-call time at the H3 shapes against cuDNN (kernel_timing.py)
  variants  launch-config variants and the planner at the 10s shape (kernel_variants.py)
Writes DIR/kernel_check.json and DIR/kernel_check.md (kernel_report.py) and prints the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

from adaptive_sparse_attention.bench.runner import environment
from adaptive_sparse_attention.kernels.arch import CONFIGS
from dense_probe import dense_probe
from kernel_correctness import correctness
from kernel_report import markdown
from kernel_timing import timing
from nvidia_tools import nsight, sanitizer

SECTIONS = ("check", "sanitize", "ncu", "probe", "timing", "variants")


def build_parser() -> argparse.ArgumentParser:
    """The tool's options."""
    parser = argparse.ArgumentParser(prog="python tools/kernel_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for kernel_check.json and kernel_check.md")
    parser.add_argument("--quick", action="store_true", help="one correctness case per block size")
    parser.add_argument("--shapes", default="5s,10s,14s", help="H3 shapes to time")
    parser.add_argument("--ratios", default="0.1,0.2,0.3", help="top-k ratios to time")
    parser.add_argument("--block-sizes", default="64", help="plan block sizes to check and time")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: " + ",".join(SECTIONS))
    return parser


def run(args: argparse.Namespace) -> dict:
    """Every section not in args.skip, then the JSON and markdown files in args.out.

    Args:
        args: the parsed options (`build_parser`).
    Returns:
        The results (a failed check shows in the printed lines and the JSON, not in the exit status).
    """
    skip = set(args.skip.split(",")) - {""}
    if skip - set(SECTIONS):
        raise SystemExit(f"--skip: unknown sections {sorted(skip - set(SECTIONS))}; sections are {', '.join(SECTIONS)}")
    results = {"device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
               "versions": f"torch {torch.__version__}, triton {triton.__version__}, nvidia-cudnn-frontend "
                           f"{environment(torch.device('cuda')).get('nvidia-cudnn-frontend', 'not installed')}",
               "date": time.strftime("%F %T"),
               "configs": {f"{f}/D{d}/bs{b}": c.__dict__ for (f, d, b), c in CONFIGS.items()}}
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
    return results


if __name__ == "__main__":
    run(build_parser().parse_args())
