"""How far can a per-head choice of tiling go? Recall of many tilings, and the best per head.

    python -m adaptive_sparse_attention.bench.tiling_ceiling [--preset h3-10s] [--scene cuts pan] [--out FILE]

On a structured scene (GPU if there is one) every head's attention-mass recall at ratio 0.1 (64
sampled target-video queries, ours without tail, as in the benchmark) is measured for the
reblock tree alone, snake tubes of several (bH, bW) patches (`tiling.snake_tiles`), cube tiles of
several (bT, bH, bW) shapes, the shipped reblock tiling (tree or tube per head,
`backend/head_choice.py`) and, for the tree and tube family (which share one block structure),
every pairing of a query tiling with a different key tiling. Then, per head, the best recall
within growing candidate sets: an upper bound for any rule that picks one of them per head.
Printed per head kind and as JSON; cube (4, 4, 4) is the baseline.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from ..backend.config import SparseConfig
from ..backend.metrics import plan_mass_metrics, sample_rows
from ..backend.planner import build_plan
from ..backend.reblock import reblock_tiling
from ..backend.scenes import Scene, make_scene
from ..backend.tiling import Tiling, assemble, cube_tiling, snake_tiles

PATCHES = ((1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (1, 4), (4, 2), (2, 1))  # snake tube patches (bH, bW)
CUBES = ((4, 4, 4), (8, 2, 4), (16, 2, 2), (2, 4, 8), (1, 8, 8), (8, 4, 2), (32, 1, 2))  # (bT, bH, bW)
MIXED = ("tree", "tube(1, 2)", "tube(2, 4)", "tube(1, 1)", "tube(2, 2)")  # query/key pairings among these
SHIPPED_SET = ("tree", "tube(1, 2)", "tube(2, 4)")  # the shipped choice's candidates (head_choice.TUBES)


def per_head_recalls(sc: Scene, ratio: float = 0.1) -> dict[str, torch.Tensor]:
    """Recall [H] of 64 sampled target-video queries per head, for every tiling named above."""
    q, k, v, layout = sc.q, sc.k, sc.v, sc.layout
    H = q.shape[1]
    rows = sample_rows(layout, 64, 0)["video"]
    cfg = SparseConfig(topk_ratio=ratio, tail="none", min_tokens=0)

    def recall(t: Tiling) -> torch.Tensor:
        r, _ = plan_mass_metrics(q, k, build_plan(q, k, v, layout, cfg, tiling=t).kernel, rows)
        return r[0].mean(-1).double().cpu()

    tree = reblock_tiling(q, k, layout, 64, ratio=ratio, tubes=False)
    family = {"tree": tree.k_perm}
    for patch in PATCHES:
        perm = assemble(layout, 64, lambda grid, p=patch: snake_tiles(grid, p, 64))[0]
        family[f"tube{patch}"] = perm.to(q.device).view(1, 1, -1).expand(1, H, -1).contiguous()

    def paired(q_perm: torch.Tensor, k_perm: torch.Tensor) -> Tiling:
        return Tiling(64, q_perm, k_perm, tree.block_len, tree.regions, tree.region_blocks)

    out = {name: recall(paired(p, p)) for name, p in family.items()}
    out.update({f"cube{tile}": recall(cube_tiling(layout, 64, q.device, tile=tile)) for tile in CUBES})
    out["reblock (shipped)"] = recall(reblock_tiling(q, k, layout, 64, ratio=ratio))
    out.update({f"q:{a} k:{b}": recall(paired(family[a], family[b]))
                for a, b in itertools.permutations(MIXED, 2)})
    return out


def ceilings(recalls: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-head best recall [H] within growing candidate sets (and the single tilings of note)."""
    def best(names) -> torch.Tensor:
        return torch.stack([recalls[n] for n in names]).max(0).values

    tubes = ["tree"] + [f"tube{p}" for p in PATCHES]
    cubes = [f"cube{c}" for c in CUBES]
    mixes = [n for n in recalls if n.startswith("q:")]
    return {"cube (4, 4, 4)": recalls["cube(4, 4, 4)"], "tree": recalls["tree"],
            "reblock (shipped)": recalls["reblock (shipped)"],
            "best of shipped candidates": best(SHIPPED_SET), "best of tree + all tubes": best(tubes),
            "best of tree + tubes + cubes": best(tubes + cubes),
            "best with query/key pairings": best(tubes + cubes + mixes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="h3-10s")
    parser.add_argument("--scene", nargs="+", default=["cuts", "pan"])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {}
    for scene in args.scene:
        sc = make_scene(scene, args.preset, seed=0, device=device,
                        dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        recalls = per_head_recalls(sc)
        base = recalls["cube(4, 4, 4)"].mean()
        kinds = sorted(set(sc.head_kinds))
        rows = {}
        for name, r in ceilings(recalls).items():
            by_kind = {kind: float(r[[h for h, x in enumerate(sc.head_kinds) if x == kind]].mean()) for kind in kinds}
            rows[name] = {"mean": float(r.mean()), "gain_points": float(100 * (r.mean() - base)), **by_kind}
            print(f"{args.preset} {scene} {name:30s} {r.mean():.4f} ({100 * (r.mean() - base):+.1f}) "
                  + " ".join(f"{kind} {v:.3f}" for kind, v in by_kind.items()), flush=True)
        result[scene] = {"ceilings": rows, "per_head": {n: [round(float(x), 4) for x in r] for n, r in recalls.items()}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "device": device, "scenes": result}, f, indent=1)


if __name__ == "__main__":
    main()
