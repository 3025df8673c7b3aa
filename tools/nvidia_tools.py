"""The kernels under NVIDIA's tools (sections `sanitize` and `ncu`), each on a child process.

compute-sanitizer memcheck runs a small case through both tail granularities and both
archs (and the cuDNN backend where it can run); Nsight Compute reads the
occupancy, stall reasons and memory and pipe throughput of one attention launch. The parent runs
this file again as the child (`python nvidia_tools.py sanitize-child|profile-child`), so the
tool sees only the launches it is meant to.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.backend.layout import SequenceLayout
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.bench.scenes import h3_qkv
from adaptive_sparse_attention.kernels.arch import ARCHS, kernel_config
from adaptive_sparse_attention.kernels.registry import unavailable_reason
from adaptive_sparse_attention.kernels.triton.attention import block_sparse_triton
from kernel_cases import DIM, H3_SHAPES, HEADS, plan_for

NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis",
                "ComputeWorkloadAnalysis")


def sanitize_child() -> None:
    """The small case compute-sanitizer watches: both granularities, both archs, and the cuDNN
    backend where it can run."""
    layout = SequenceLayout.from_segments([(0, 100, "text"), (100, 100 + 3 * 10 * 12, "video", (3, 10, 12))])
    for gran in ("query", "block"):
        q, k, v = h3_qkv(layout, 2, 128, torch.bfloat16, seed=1)
        plan = build_plan(q, k, v, layout, SparseConfig(tiling="cube", topk_ratio=0.3, tail_granularity=gran))
        for arch in ARCHS:
            block_sparse_triton(q, k, v, plan, config=kernel_config(128, 64, q.device, arch=arch))
        if unavailable_reason("cudnn", q.device, q.dtype, 128, 64) is None:
            from adaptive_sparse_attention.kernels.cudnn.cudnn_attention import block_sparse_cudnn
            from adaptive_sparse_attention.kernels.registry import helper

            block_sparse_cudnn(q, k, v, plan, helper("triton", "tiled_pack"), helper("triton", "add_tail"))
    torch.cuda.synchronize()
    print("sanitize-child done")


def profile_child() -> None:
    """Three kernel launches at the 5s shape, ratio 0.1, query tails; Nsight Compute reads the third
    (the first two compile and warm up)."""
    layout = H3_SHAPES["5s"].layout()
    q, k, v = h3_qkv(layout, HEADS, DIM, torch.bfloat16, seed=5)
    plan, _ = plan_for(q, k, v, layout, 0.1)
    for _ in range(3):
        block_sparse_triton(q, k, v, plan)
    torch.cuda.synchronize()
    print("profile-child done")


def child(role: str) -> list[str]:
    """The command line that runs this file as the child `role`."""
    return [sys.executable, os.path.abspath(__file__), role]


def sanitizer(results: dict) -> None:
    """compute-sanitizer memcheck of `sanitize_child` into results["sanitizer"] (or why it did not run)."""
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        results["sanitizer"] = "compute-sanitizer not found"
        return
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "9", *child("sanitize-child")]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        tail = (p.stdout + p.stderr)[-1500:]
        results["sanitizer"] = {"returncode": p.returncode, "tail": tail}
        print(f"compute-sanitizer memcheck rc={p.returncode}:", tail[-400:], flush=True)
    except subprocess.TimeoutExpired:
        results["sanitizer"] = "timed out after 300 s"


def nsight(results: dict) -> None:
    """Nsight Compute sections of `profile_child`'s third launch into results["ncu"] (clocks untouched)."""
    tool = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)
    if tool is None:
        results["ncu"] = "ncu not found"
        return
    cmd = [tool, "--clock-control", "none", "--kernel-name", "regex:_block_sparse_fwd", "--launch-skip", "2",
           "--launch-count", "1", *[a for sec in NCU_SECTIONS for a in ("--section", sec)], *child("profile-child")]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        results["ncu"] = {"returncode": p.returncode, "report": (p.stdout + p.stderr)[-12000:]}
        print(p.stdout[-8000:], p.stderr[-1000:], flush=True)
    except subprocess.TimeoutExpired:
        results["ncu"] = "timed out after 240 s"


if __name__ == "__main__":
    {"sanitize-child": sanitize_child, "profile-child": profile_child}[sys.argv[1]]()
