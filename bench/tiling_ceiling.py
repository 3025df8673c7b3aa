"""How far can a tiling go? Recall of many tilings, the best per head, and where recall is lost.

    python -m adaptive_sparse_attention tiling-ceiling [--preset h3-10s] [--scene cuts pan]
        [--part ceiling losses] [--out FILE]

On a structured scene (GPU if there is one) every head's attention-mass recall at ratio 0.1 (64
sampled target-video queries, ours without tail, as in the benchmark) is measured for the
reblock tree alone, snake tubes of several (bH, bW) patches (`tiling.snake_tiles`), cube tiles of
several (bT, bH, bW) shapes, the shipped reblock tiling (tree or tube per head,
`backend/head_choice.py`) and, for the tree and tube tilings (which share one block structure),
every pairing of a query tiling with a different key tiling. Then, per head, the best recall
within growing candidate sets: an upper bound for any rule that picks one of them per head.
Printed per head kind and as JSON; cube (4, 4, 4) is the baseline.

Losses (`recall_losses`): for cube, the tree and the shipped tiling, the recall of every row of the
query blocks that hold the sampled queries, in four nested stages, each an upper bound of the
next: the best `R * block_size` video tokens per row (token oracle, the same for every tiling),
the best R key blocks per row (what the key partition allows), the best R key blocks per query
block (what sharing one selection among a block's queries allows), and the blocks routing
picks. The drops between them are the key partition's, the query grouping's and the routing's
share of the loss.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from ..errors import SparseAttentionError
from ..backend.config import SparseConfig
from ..backend.layout import TARGET_VIDEO, SequenceLayout
from .metrics import block_of_rows, plan_mass_metrics, sample_rows
from ..backend.planner import build_plan
from ..backend.reblock import reblock_tiling
from ..backend.routing import region_budget
from .scenes import Scene, make_scene
from ..backend.tiling import Tiling, assemble, cube_tiles, cube_tiling, snake_perm
from ..kernels.plan import BlockSparsePlan

PATCHES = ((1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (1, 4), (4, 2), (2, 1))  # snake tube patches (bH, bW)
CUBES = ((4, 4, 4), (8, 2, 4), (16, 2, 2), (2, 4, 8), (1, 8, 8), (8, 4, 2), (32, 1, 2))  # (bT, bH, bW)
MIXED = ("tree", "tube(1, 2)", "tube(2, 4)", "tube(1, 1)", "tube(2, 2)")  # query/key pairings among these
SHIPPED_SET = ("tree", "tube(1, 2)", "tube(2, 4)")  # the shipped choice's candidates (head_choice.TUBES)
STAGES = ("token oracle", "best blocks per query", "best blocks per query block", "routed")


def cube_shape_tiling(layout: SequenceLayout, tile: tuple[int, int, int], device: torch.device | str = "cpu"
                      ) -> Tiling:
    """`cube_tiling` of 64-row blocks with (bT, bH, bW) tiles `tile` instead of the shipped (4, 4, 4)."""
    if len(tile) != 3 or min(tile) < 1 or math.prod(tile) != 64:
        raise SparseAttentionError(f"cube_shape_tiling: tile={tile} is not allowed: expected three positive sizes whose "
                         "product is the block size, 64")
    perm, block_len, spans = assemble(layout, 64, lambda grid: cube_tiles(grid, tuple(tile)))
    perm = perm.view(1, 1, -1).to(device)
    return Tiling(64, perm, perm, block_len.to(device), tuple(layout.regions()), spans)


def routed_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, tiling: Tiling,
                ratio: float = 0.1) -> BlockSparsePlan:
    """The kernel plan routed on `tiling` at `ratio`, without tail summaries (recall counts only
    exactly computed keys)."""
    cfg = SparseConfig(topk_ratio=ratio, tail="none", min_tokens=0)
    return build_plan(q, k, v, layout, cfg, tiling=tiling)


def head_recall(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, tiling: Tiling,
                rows: torch.Tensor, ratio: float = 0.1) -> torch.Tensor:
    """Mean attention-mass recall per head [H] (float64, CPU) of query `rows` under `routed_plan`."""
    recall, _ = plan_mass_metrics(q, k, routed_plan(q, k, v, layout, tiling, ratio), rows)
    return recall[0].mean(-1).double().cpu()


def per_head_recalls(sc: Scene, ratio: float = 0.1) -> dict[str, torch.Tensor]:
    """Recall [H] of 64 sampled target-video queries per head, for every tiling named above."""
    q, k, v, layout = sc.q, sc.k, sc.v, sc.layout
    H = q.shape[1]
    rows = sample_rows(layout, 64, 0)["video"]

    def recall(t: Tiling) -> torch.Tensor:
        return head_recall(q, k, v, layout, t, rows, ratio)

    tree = reblock_tiling(q, k, layout, 64, ratio=ratio, tubes=False)
    pairable = {"tree": tree.k_perm}
    for patch in PATCHES:
        perm = snake_perm(layout, 64, patch)
        pairable[f"tube{patch}"] = perm.to(q.device).view(1, 1, -1).expand(1, H, -1).contiguous()

    def paired(q_perm: torch.Tensor, k_perm: torch.Tensor) -> Tiling:
        return Tiling(64, q_perm, k_perm, tree.block_len, tree.regions, tree.region_blocks)

    out = {name: recall(paired(p, p)) for name, p in pairable.items()}
    out.update({f"cube{tile}": recall(cube_shape_tiling(layout, tile, q.device)) for tile in CUBES})
    out["reblock (shipped)"] = recall(reblock_tiling(q, k, layout, 64, ratio=ratio))
    out.update({f"q:{a} k:{b}": recall(paired(pairable[a], pairable[b]))
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


def recall_losses(sc: Scene, tiling: Tiling, ratio: float = 0.1) -> dict[str, torch.Tensor]:
    """Recall [H] at each of the STAGES (see the module docstring), averaged over every row of the
    query blocks that hold 64 sampled target-video queries (per head; a block sampled twice counts
    twice). Exact in fp32 from full logit rows, one head at a time."""
    q, k, v, layout = sc.q, sc.k, sc.v, sc.layout
    _, H, S, D = q.shape
    bs = tiling.block_size
    plan = routed_plan(q, k, v, layout, tiling, ratio)
    allowed = plan.allowed_mask()[0]  # [H, J, J]
    lo, hi = tiling.blocks_of(TARGET_VIDEO)
    video = next(seg for seg in layout.regions() if seg.region == TARGET_VIDEO)
    budget = region_budget(hi - lo, ratio)
    tokens = min(video.length, region_budget(-(-video.length // bs), ratio) * bs)  # the same for every tiling
    rows = sample_rows(layout, 64, 0)["video"].to(q.device)
    q_block, k_block = (block_of_rows(p, bs, S)[0] for p in (plan.q_perm, plan.k_perm))  # [Hp, S]
    out = torch.empty(len(STAGES), H, dtype=torch.float64)
    for h in range(H):
        hq, hk = min(h, q_block.shape[0] - 1), min(h, k_block.shape[0] - 1)
        blocks = q_block[hq, rows]  # [n]
        members = plan.q_perm[0, hq].view(-1, bs)[blocks].long()  # [n, bs], -1 pads
        valid = members >= 0
        p = torch.softmax(q[0, h, members.clamp(min=0).view(-1)].float() @ k[0, h].float().T * D ** -0.5, -1)
        mass = torch.zeros(p.shape[0], tiling.num_blocks, device=q.device).index_add_(1, k_block[hk], p)
        exact = (mass * (torch.arange(tiling.num_blocks, device=q.device) < plan.dense_hi[blocks].repeat_interleave(bs)
                         .view(-1, 1))).sum(-1)
        cand = mass[:, lo:hi].view(len(blocks), bs, hi - lo)
        picks = cand.masked_fill(~valid.unsqueeze(-1), 0).sum(1).topk(budget, -1).indices  # [n, R]
        stages = (exact + p[:, video.start:video.stop].topk(tokens, -1).values.sum(-1),
                  exact + mass[:, lo:hi].topk(budget, -1).values.sum(-1),
                  exact + cand.gather(2, picks.unsqueeze(1).expand(-1, bs, -1)).sum(-1).view(-1),
                  (mass.view(len(blocks), bs, -1) * allowed[min(h, allowed.shape[0] - 1), blocks].unsqueeze(1)).sum(-1).view(-1))
        for i, r in enumerate(stages):
            out[i, h] = r.view(-1)[valid.view(-1)].double().mean()
    return {name: out[i] for i, name in enumerate(STAGES)}


def by_kind(r: torch.Tensor, kinds: tuple[str, ...]) -> dict[str, float]:
    """Mean of per-head values r [H] per head kind."""
    return {kind: float(r[[h for h, x in enumerate(kinds) if x == kind]].mean()) for kind in sorted(set(kinds))}


def _row(r: torch.Tensor, base: torch.Tensor, kinds: tuple[str, ...]) -> dict[str, float]:
    return {"mean": float(r.mean()), "gain_points": float(100 * (r.mean() - base.mean())), **by_kind(r, kinds)}


def _print(label: str, row: dict[str, float]) -> None:
    print(f"{label:58s} {row['mean']:.4f} ({row['gain_points']:+.1f}) "
          + " ".join(f"{kind} {v:.3f}" for kind, v in row.items() if kind not in ("mean", "gain_points")), flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="h3-10s")
    parser.add_argument("--scene", nargs="+", default=["cuts", "pan"])
    parser.add_argument("--part", nargs="+", choices=("ceiling", "losses"), default=["ceiling", "losses"])
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    """The parts in args.part on every scene of args.scene at args.preset (on the GPU when there
    is one); prints one line per result and writes the JSON to args.out when given. Returns 0."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {}
    for scene in args.scene:
        sc = make_scene(scene, args.preset, seed=0, device=device,
                        dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        entry = result[scene] = {}
        if "ceiling" in args.part:
            recalls = per_head_recalls(sc)
            base = recalls["cube(4, 4, 4)"]
            entry["ceilings"] = {name: _row(r, base, sc.head_kinds) for name, r in ceilings(recalls).items()}
            entry["per_head"] = {n: [round(float(x), 4) for x in r] for n, r in recalls.items()}
            for name, row in entry["ceilings"].items():
                _print(f"{args.preset} {scene} {name}", row)
        if "losses" in args.part:
            q, k, layout = sc.q, sc.k, sc.layout
            tilings = {"cube (4, 4, 4)": cube_tiling(layout, 64, q.device), "tree": reblock_tiling(q, k, layout, 64, tubes=False),
                       "reblock (shipped)": reblock_tiling(q, k, layout, 64)}
            losses = {name: recall_losses(sc, t) for name, t in tilings.items()}
            base = losses["cube (4, 4, 4)"]["routed"]
            entry["losses"] = {name: {stage: _row(r, base, sc.head_kinds) for stage, r in stages.items()}
                               for name, stages in losses.items()}
            for name, stages in entry["losses"].items():
                for stage, row in stages.items():
                    _print(f"{args.preset} {scene} {name}: {stage}", row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "device": device, "scenes": result}, f, indent=1)
    return 0
