"""Probe: choose every head's tiling (the reblock tree or a fixed space-time shape) by sampled mass.

    python -m adaptive_sparse_attention.bench.tiling_choice [--scene cuts] [--video T H W] [--heads 8]

On a structured scene (CPU or GPU), builds the reblock tree tiling and cube tilings of several
tile shapes, and measures for each the attention-mass recall at ratio 0.1 of 64 sampled
target-video queries per head (ours, no tail). A proxy then picks one tiling per head: the one
whose R heaviest target-video key blocks hold the most exact softmax mass of 64 *other* sampled
queries. Prints per-head recall and proxy of every candidate, the proxy's picks, and the mean
recall of cube, tree, proxy-chosen and best-per-head (oracle) tilings. `reblock` is the shipped
tiling, which makes the same kind of choice between the tree and snake tubes
(backend/head_choice.py); this probe explores other shapes (docs/performance-notes.md).
"""
from __future__ import annotations

import argparse

import torch

from ..backend.config import SparseConfig
from ..backend.layout import TARGET_VIDEO
from ..backend.metrics import block_of_rows, plan_mass_metrics, sample_rows
from ..backend.planner import build_plan
from ..backend.reblock import reblock_tiling
from ..backend.routing import region_budget
from ..backend.scenes import SceneSize, make_scene
from ..backend.tiling import cube_tiling

SHAPES = ((4, 4, 4), (16, 2, 2), (8, 2, 4), (32, 1, 2), (4, 2, 8), (2, 4, 8))  # (bT, bH, bW) tiles of 64 tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scene", default="cuts")
    parser.add_argument("--video", type=int, nargs=3, default=(16, 24, 42))
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    size = SceneSize(256, 414, tuple(args.video), args.heads, 128)
    sc = make_scene(args.scene, size, seed=0, device=args.device)
    q, k, v, layout = sc.q, sc.k, sc.v, sc.layout
    H, S, D = q.shape[1], q.shape[2], q.shape[3]
    rows, probe = (sample_rows(layout, 64, seed)["video"].to(q.device) for seed in (0, 1))
    cfg = SparseConfig(topk_ratio=0.1, tail="none", min_tokens=0)
    cands = {str(s): cube_tiling(layout, 64, q.device, tile=s) for s in SHAPES}
    cands["tree"] = reblock_tiling(q, k, layout, 64, tubes=False)
    p = torch.softmax(torch.einsum("hnd,hsd->hns", q[0][:, probe], k[0]) * D ** -0.5, -1)
    true, proxy = {}, {}
    for name, t in cands.items():
        recall, _ = plan_mass_metrics(q, k, build_plan(q, k, v, layout, cfg, tiling=t).kernel, rows)
        true[name] = recall[0].mean(-1).cpu()
        lo, hi = t.blocks_of(TARGET_VIDEO)
        blocks = block_of_rows(t.k_perm, 64, S)[0].expand(H, S).unsqueeze(1).expand(-1, len(probe), -1)
        mass = torch.zeros(H, len(probe), t.num_blocks, device=q.device).scatter_add_(2, blocks, p)
        proxy[name] = mass[..., lo:hi].topk(region_budget(hi - lo, 0.1), -1).values.sum(-1).mean(-1).cpu()
        print(f"{name:10s} recall {true[name].mean():.4f} per head {[round(x, 3) for x in true[name].tolist()]}"
              f"  proxy {[round(x, 3) for x in proxy[name].tolist()]}")
    shipped, _ = plan_mass_metrics(q, k, build_plan(q, k, v, layout, cfg, tiling=reblock_tiling(q, k, layout, 64)).kernel,
                                   rows)
    names = list(cands)
    recalls = torch.stack([true[n] for n in names])
    pick = torch.stack([proxy[n] for n in names]).argmax(0)
    chosen = recalls.gather(0, pick.view(1, -1)).squeeze(0)
    print(f"{args.scene} {tuple(args.video)}: cube {true[str(SHAPES[0])].mean():.4f} tree {true['tree'].mean():.4f} "
          f"proxy-chosen {chosen.mean():.4f} oracle {recalls.max(0).values.mean():.4f} "
          f"reblock (shipped) {shipped.mean():.4f}; "
          f"picks {[names[i] for i in pick.tolist()]}")


if __name__ == "__main__":
    main()
