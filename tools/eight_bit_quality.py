"""Quality of the 8-bit exact loop on the bench scenes (CPU, the torch backend's same-quantisation reference).

Per scene (`bench/scenes.py`, pan, cuts and gaussian at `--size`, bf16 inputs) and ratio: the rel L2
error against dense fp32 attention (SDPA on the fp32 values of the bf16 inputs, every head and row)
of our op in bf16 and in 8 bits (FP8 P.V as on sm89+, INT8 P.V as on sm80/86), also with one
channel of K, or of Q, scaled by 1000 (an outlier channel). The torch backend runs the arithmetic
the Triton kernel runs on the GPU (tests/test_eight_bit.py holds the two together). Prints one
line per case and writes JSON (--out).

    python tools/eight_bit_quality.py --size cpu-small --ratios 0.2 --out eight_bit_quality.json
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from adaptive_sparse_attention import SparseConfig, sparse_attention
from adaptive_sparse_attention.bench.scenes import SCENES, make_scene
from adaptive_sparse_attention.kernels.arch import ARCH_ENV

VARIANTS = ("plain", "k channel x1000", "q channel x1000")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def variant(q: torch.Tensor, k: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k with channel 5 of K (or Q) scaled by 1000 (in fp32, then back to the inputs' dtype)."""
    if name == "plain":
        return q, k
    x = (k if name.startswith("k") else q).float().clone()
    x[..., 5] *= 1000.0
    x = x.to(q.dtype)
    return (q, x) if name.startswith("k") else (x, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="cpu-small")
    parser.add_argument("--ratios", default="0.2")
    parser.add_argument("--out", default="eight_bit_quality.json")
    args = parser.parse_args()
    rows = []
    for scene_name in SCENES:
        scene = make_scene(scene_name, args.size, seed=0, dtype=torch.bfloat16)
        for vname in VARIANTS:
            q, k = variant(scene.q, scene.k, vname)
            v = scene.v
            dense = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
            for ratio in (float(r) for r in args.ratios.split(",")):
                cfg = SparseConfig(topk_ratio=ratio, kernel="torch", min_tokens=0)
                row = {"scene": scene_name, "inputs": vname, "ratio": ratio,
                       "bf16": rel(sparse_attention(q, k, v, scene.layout, cfg), dense)}
                for arch, pv in (("sm89", "fp8"), ("sm80", "int8")):
                    os.environ[ARCH_ENV] = arch  # the P.V format of that arch
                    try:
                        out = sparse_attention(q, k, v, scene.layout, cfg.replace(precision="8-bit"))
                    finally:
                        del os.environ[ARCH_ENV]
                    row[f"8-bit {pv}"] = rel(out, dense)
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"size": args.size, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
