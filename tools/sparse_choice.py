"""The measured sparse-kernel choice of ``kernel="auto"`` on this GPU: per ratio and precision bound, every
candidate's time and error on the sampled rows, the chosen one, and the whole op under ``auto`` after it.

H3 shapes at 1344x768 (`bench.scenes.SIZES`), bf16 random q/k/v laid out as H3's attention hands them
over (strided views of one fused projection), node defaults but the ratio. Nothing is saved (the choice
is measured in this process). Run from the repository root with the package importable:

    python tools/sparse_choice.py --sizes h3-10s --ratios 0.1,0.2 --out sparse_choice.json
"""
from __future__ import annotations

import argparse
import json
import logging

import torch

from adaptive_sparse_attention.backend.attention import sparse_attention
from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.bench.scenes import strided_qkv
from adaptive_sparse_attention.bench.scenes import SIZES
from adaptive_sparse_attention.bench.timing import bench_ms
from adaptive_sparse_attention.kernels.sparse_choice.choice import SparseChoices


def measure(size_name: str, ratio: float, precision: str) -> dict:
    """One measured choice (a fresh `SparseChoices`, in memory only) and the op's median under it."""
    size = SIZES[size_name]
    q, k, v = strided_qkv(size.total, size.heads, size.head_dim, torch.bfloat16, torch.device("cuda"))
    layout = size.layout()
    config = SparseConfig(topk_ratio=ratio, precision=precision)
    choices = SparseChoices(persist=False)
    ran: list[tuple[str, str]] = []
    sparse_attention(q, k, v, layout, config, choices=choices, ran=lambda name, summary: ran.append((name, summary)))
    op_ms = bench_ms(lambda: sparse_attention(q, k, v, layout, config, choices=choices))
    name, summary = ran[0]
    return {"size": size_name, "ratio": ratio, "bound": precision, "chosen": name, "op_auto_ms": op_ms,
            "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="h3-10s", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--ratios", default="0.1,0.2")
    p.add_argument("--bounds", default="bf16,8-bit", help="precision bounds (bf16, 8-bit)")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # skipped candidates are warnings
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for size in args.sizes.split(","):
        for ratio in (float(r) for r in args.ratios.split(",")):
            for bound in args.bounds.split(","):
                row = measure(size, ratio, bound)
                rows.append(row)
                print(f"{size} ratio {ratio} bound {bound}: chosen {row['chosen']}, op under auto "
                      f"{row['op_auto_ms']:.1f} ms\n  {row['summary']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
