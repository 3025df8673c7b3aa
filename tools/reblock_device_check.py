"""Reblock tiling built on the GPU vs on the CPU from the same tensors, on a structured scene.

    python tools/reblock_device_check.py [--preset h3-5s] [--scene pan] [--heads 8] [--out FILE]

Builds the scene on the GPU (bf16), the reblock tiling (q_reuse_k, block 64) on the GPU and, from
CPU copies of the same tensors, on the CPU; routes both on the GPU (ratio 0.1, no tail) and
reports the attention-mass recall of 64 sampled target-video queries per head (all heads, and
per head for the first `--heads`), the share of permutation entries that agree, the largest
difference of the target-video tree features and of the per-head choice's block log-masses
(Triton in bf16 vs float64 on the CPU) between the devices, which tiling every head took on
each device (0 the tree, i the i-th tube), and the recall of the tree alone. The tiling must
not depend on the device it is built on (beyond rounding), so the two recalls should agree.
"""
from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.backend.head_choice import block_log_mass, probe_rows, tube_perms
from adaptive_sparse_attention.backend.layout import TARGET_VIDEO, SequenceLayout
from adaptive_sparse_attention.backend.planner import make_tiling
from adaptive_sparse_attention.backend.reblock import metric_features, reblock_tiling
from adaptive_sparse_attention.backend.tiling import Tiling
from adaptive_sparse_attention.kernels.registry import resolve
from adaptive_sparse_attention.bench.metrics import sample_rows
from adaptive_sparse_attention.bench.scenes import make_scene
from adaptive_sparse_attention.bench.tiling_ceiling import head_recall

TilingFn = Callable[[torch.Tensor, torch.Tensor, SequenceLayout, int], Tiling]


def on_device(t: Tiling, device: torch.device) -> Tiling:
    """`t` with its tensors moved to `device`."""
    return Tiling(t.block_size, t.q_perm.to(device), t.k_perm.to(device), t.block_len.to(device),
                  t.regions, t.region_blocks)


def picks(t: Tiling, layout: SequenceLayout) -> list[int]:
    """Per head: 0 where the head kept the tree, i where it took the i-th tube."""
    tubes = tube_perms(layout, t.block_size, t.k_perm.device)
    same = (t.k_perm[0].unsqueeze(1) == tubes.unsqueeze(0)).all(-1)  # [H, tubes]
    return torch.where(same.any(1), same.int().argmax(1) + 1, 0).tolist()


def compare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, rows: torch.Tensor,
            tiling_fn: TilingFn, heads: int) -> dict:
    """GPU-built vs CPU-built tiling of `tiling_fn` on the same tensors (q, k, v on the GPU)."""
    gpu = tiling_fn(q, k, layout, 64, kernels=resolve("triton", q.device, q.dtype, strict=True))
    cpu = on_device(tiling_fn(q.cpu(), k.cpu(), layout, 64), q.device)
    out = {"perm_agreement": float((gpu.k_perm == cpu.k_perm).double().mean()),
           "picks_gpu": picks(gpu, layout), "picks_cpu": picks(cpu, layout)}
    for name, t in (("gpu", gpu), ("cpu", cpu)):
        r = head_recall(q, k, v, layout, t, rows)
        out[f"recall_{name}"] = round(float(r.mean()), 4)
        out[f"recall_{name}_first_heads"] = round(float(r[:heads].mean()), 4)
        out[f"recall_{name}_per_head"] = [round(x, 3) for x in r[:heads].tolist()]
    return out


def build_parser() -> argparse.ArgumentParser:
    """The tool's options."""
    parser = argparse.ArgumentParser(prog="python tools/reblock_device_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="h3-5s")
    parser.add_argument("--scene", default="pan")
    parser.add_argument("--heads", type=int, default=8, help="heads reported one by one")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser


def run(args: argparse.Namespace) -> int:
    """The comparison above on args.scene at args.preset; prints the JSON and writes it to args.out
    when given. Returns 0."""
    dev = torch.device("cuda")
    sc = make_scene(args.scene, args.preset, seed=0, device=dev, dtype=torch.bfloat16)
    q, k, v, layout = sc.q, sc.k, sc.v, sc.layout
    rows = sample_rows(layout, 64, 0)["video"]
    triton = resolve("triton", dev, q.dtype, strict=True)
    res: dict = {"preset": args.preset, "scene": args.scene, "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__}
    cube = head_recall(q, k, v, layout, make_tiling(q, k, layout, SparseConfig(tiling="cube")), rows)
    res["recall_cube"] = round(float(cube.mean()), 4)
    res["recall_cube_per_head"] = [round(x, 3) for x in cube[:args.heads].tolist()]
    res.update(compare(q, k, v, layout, rows, reblock_tiling, args.heads))
    seg, H, D = layout.target, q.shape[1], q.shape[-1]
    qs = q[:, :, seg.start:seg.stop].reshape(H, seg.length, D)
    ks = k[:, :, seg.start:seg.stop].reshape(H, seg.length, D)
    diff = (metric_features(ks, qs, triton).cpu() - metric_features(ks.cpu(), qs.cpu())).abs().amax((1, 2))
    res["feature_max_abs_diff_per_head"] = [float(f"{x:.2e}") for x in diff[:args.heads].tolist()]
    res["feature_max_abs_diff"] = float(diff.max())
    tree = reblock_tiling(q, k, layout, 64, tubes=False, kernels=triton)
    probes = q[0].index_select(1, probe_rows(layout).to(dev))
    window = tube_perms(layout, 64, dev)[:1, tree.blocks_of(TARGET_VIDEO)[0] * 64:]
    mass = block_log_mass(probes, k[0], window, 64, triton).cpu() - block_log_mass(probes.cpu().double(), k[0].cpu().double(),
                                                                          window.cpu(), 64)
    res["block_log_mass_max_abs_diff"] = float(mass.abs().max())
    res["recall_tree_only_gpu"] = round(float(head_recall(q, k, v, layout, tree, rows).mean()), 4)
    print(json.dumps(res), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(build_parser().parse_args()))
