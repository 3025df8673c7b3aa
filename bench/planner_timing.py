"""GPU timing of the planner with and without the fused Triton kernels (`kernels/triton/block_stats.py`).

    python -m adaptive_sparse_attention planner-timing [--out FILE] [--shape 10s] [--ratio 0.1]

At an H3 shape (bf16, q/k/v as views of one buffer, cube tiling), times each planner step and
`build_plan` (reweight and mean tails, query granularity) on the torch backend (the reference) and on the
Triton backend (the fused kernels of `kernels/triton/block_stats.py`, `block_scores.py`, `block_select.py`; CUDA events, warm-up, median). Checks the fused results against the torch path
on the same GPU (max error relative to the largest reference value, selections equal),
identical bits on a rerun and no host synchronisation.
"""
from __future__ import annotations

import argparse
import json

import torch

from ..backend.config import SparseConfig
from ..backend.planner import build_plan, make_tiling
from ..backend.pooling import block_means
from ..backend.routing import pooled_scores, route_plan, select_blocks
from ..backend.tail import mean_summaries, reweight_summaries, target_anchor
from .scenes import SIZES, h3_qkv
from ..kernels.registry import resolve
from .timing import bench_ms


def steps(q, k, v, layout, ratio: float, backend: str = "triton") -> dict:
    """name -> callable of every planner step on `backend`'s kernels (later steps read earlier
    results from `state`)."""
    cfg = SparseConfig(tiling="cube", topk_ratio=ratio, tail="reweight", tail_granularity="query", kernel=backend)
    kernels = resolve(backend, q.device, q.dtype)
    tiling = make_tiling(q, k, layout, cfg, kernels)
    state: dict = {}
    parts = {
        "block_means q": lambda: block_means(q, tiling.q_perm, tiling, kernels),
        "block_means k": lambda: block_means(k, tiling.k_perm, tiling, kernels),
        "block_means v (coarse tail)": lambda: block_means(v, tiling.k_perm, tiling, kernels),
        "pooled_scores": lambda: pooled_scores(state["block_means q"], state["block_means k"], kernels=kernels),
        "route_plan": lambda: route_plan(tiling, cfg.sparse_scope, ratio),
        "select_blocks": lambda: select_blocks(state["pooled_scores"], *state["route_plan"], kernels),
        "target_anchor": lambda: target_anchor(state["block_means q"], tiling),
        "reweight_summaries": lambda: reweight_summaries(k, v, tiling, state["target_anchor"], kernels),
        "mean_summaries": lambda: mean_summaries(k, v, tiling, kernels),
        "build_plan reweight": lambda: build_plan(q, k, v, layout, cfg),
        "build_plan mean": lambda: build_plan(q, k, v, layout, cfg.replace(tail="mean")),
    }

    def run(name):
        state[name] = parts[name]()
        return state[name]

    return {name: (lambda name=name: run(name)) for name in parts}


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (the error against the reference's scale)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def outputs(result) -> dict[str, torch.Tensor]:
    """The tensors of one step's result, named."""
    if isinstance(result, torch.Tensor):
        return {"": result}
    if isinstance(result, tuple):
        return {f"[{i}]": t for i, t in enumerate(result) if isinstance(t, torch.Tensor)}
    tail = result.tail  # a plan with query summaries
    return {".q2k_idx": result.q2k_idx, ".tail.key": tail.key, ".tail.value": tail.value, ".tail.bias": tail.bias}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--shape", default="10s", choices=("5s", "10s", "14s"), help="H3 clip (default 10s)")
    parser.add_argument("--ratio", type=float, default=0.1)


def run(args: argparse.Namespace) -> int:
    """Time and check both paths at args.shape and args.ratio; prints a table and the JSON,
    writes the JSON to args.out when given. Returns 0."""
    import triton

    size = SIZES[f"h3-{args.shape}"]
    layout = size.layout()
    q, k, v = h3_qkv(layout, size.heads, size.head_dim, torch.bfloat16, seed=11)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "shape": {"name": args.shape, "B": 1, "H": size.heads, "S": layout.total, "D": size.head_dim,
                           "dtype": "bf16", "ratio": args.ratio}, "ms": {}, "max_rel_err": {}}
    runs = {}
    for path in ("torch", "fused"):
        parts = steps(q, k, v, layout, args.ratio, "triton" if path == "fused" else "torch")
        runs[path] = {name: fn() for name, fn in parts.items()}  # warm-up, compile, keep results
        res["ms"][path] = {name: bench_ms(fn, rep_ms=300) for name, fn in parts.items()}
        if path == "fused":
            again = {name: fn() for name, fn in parts.items()}
            res["fused_bits_identical_on_rerun"] = all(
                torch.equal(a, outputs(again[n])[o]) for n in again for o, a in outputs(runs[path][n]).items())
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for name in ("block_means q", "select_blocks", "reweight_summaries", "mean_summaries"):
                    parts[name]()
                res["fused_host_sync"] = "none"
            except RuntimeError as e:
                res["fused_host_sync"] = str(e).splitlines()[0]
            finally:
                torch.cuda.set_sync_debug_mode("default")
    for name, result in runs["fused"].items():
        for out, got in outputs(result).items():
            ref = outputs(runs["torch"][name])[out]
            if not got.is_floating_point():
                res["max_rel_err"][f"{name}{out} rows equal"] = float((got == ref).all(-1).float().mean())
            else:
                res["max_rel_err"][f"{name}{out}"] = max_rel(got, ref)
    print(json.dumps(res), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"\n{res['device']}, {res['torch']}, triton {res['triton']}, shape {res['shape']}")
    print(f"{'step':32s} {'torch ms':>9s} {'fused ms':>9s}")
    for name in res["ms"]["torch"]:
        print(f"{name:32s} {res['ms']['torch'][name]:9.3f} {res['ms']['fused'][name]:9.3f}")
    print("fused vs torch path (max |diff| / max |ref|; selections: fraction of equal rows):")
    for name, err in res["max_rel_err"].items():
        print(f"  {name:40s} {err:.3g}")
    print(f"bits identical on rerun: {res['fused_bits_identical_on_rerun']}; host sync: {res['fused_host_sync']}")
    return 0
