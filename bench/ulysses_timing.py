"""Ulysses sequence parallelism at an H3 shape: sparse attention on each GPU's head group.

    torchrun --nproc-per-node 2 -m adaptive_sparse_attention ulysses-timing [--out FILE]
        [--video T H W] [--heads H] [--ratio R] [--tiling reblock|cube]

What Raylight's xFuser path does around attention, without Ray or xFuser: every rank holds its
rows of the sequence (padded to a multiple of the ranks), an all-to-all gives it all rows of
H/P heads, attention runs there, and an all-to-all gives the rows back. Times per rank (median,
CUDA events): the whole sparse call (`sequence_parallel_attention`), its local part on H/P heads,
the four all-to-alls alone, and the same path with dense SDPA in place of ours (what xFuser runs
without our node, padding rows included); on rank 0 also one GPU with all heads, sparse and
dense, for the speed-up. It checks that every rank's output rows equal one GPU's (the plan of a
head does not depend on the other heads). Random inputs (bf16 on CUDA, fp32 on the CPU with gloo).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..backend.attention import sparse_attention
from ..backend.config import SparseConfig
from .scenes import SceneSize
from ..backend.ulysses import (check_sequence_parallel, heads_to_seq, local_heads_attention, padded_rows,
                               seq_to_heads, sequence_parallel_attention)
from .timing import time_call


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA on [B, S, h, D] tensors (xFuser's layout)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    parser.add_argument("--video", type=int, nargs=3, default=(72, 24, 42), help="latent grid (10 s clip default)")
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--ratio", type=float, default=0.1)
    parser.add_argument("--tiling", default="reblock", choices=("reblock", "cube"))


def run(args: argparse.Namespace) -> int:
    """One rank of the measurement (started by torchrun, which sets the process group's
    environment); rank 0 prints the report and writes it to args.out when given. Returns 0, or 2
    when not started by torchrun."""
    if "RANK" not in os.environ:
        print("ulysses-timing runs one process per rank: start it with torchrun --nproc-per-node N -m "
              "adaptive_sparse_attention ulysses-timing", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    check_sequence_parallel(args.heads, world)
    layout = SceneSize(256, 810, tuple(args.video), args.heads, 128).layout()
    S, H, D = layout.total, args.heads, 128
    cfg = SparseConfig(topk_ratio=args.ratio, tiling=args.tiling, warmup_mode="speed", min_tokens=0)
    gen = torch.Generator(device=dev).manual_seed(0)  # the same whole sequence on every rank
    q, k, v = (torch.randn(1, H, S, D, device=dev, dtype=torch.bfloat16 if cuda else torch.float32, generator=gen)
               for _ in range(3))
    rows = padded_rows(S, world) // world

    def my_rows(t: torch.Tensor) -> torch.Tensor:
        padded = t.new_zeros(1, rows * world, H, D)
        padded[:, :S] = t.transpose(1, 2)
        return padded[:, rank * rows:(rank + 1) * rows].contiguous()

    shards = [my_rows(t) for t in (q, k, v)]
    local = [seq_to_heads(t) for t in shards]
    one_gpu = sparse_attention(q, k, v, layout, cfg)
    diff = (sequence_parallel_attention(*shards, layout, cfg) - my_rows(one_gpu)).abs().max().float()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    del one_gpu
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    res = {"ulysses_sparse_ms": time_call(lambda: sequence_parallel_attention(*shards, layout, cfg), dev),
           "local_sparse_ms": time_call(lambda: local_heads_attention(*local, layout, cfg), dev),
           "all_to_alls_ms": time_call(lambda: [seq_to_heads(t) for t in shards] + [heads_to_seq(local[0])], dev),
           "ulysses_dense_ms": time_call(lambda: heads_to_seq(dense(*(seq_to_heads(t) for t in shards))), dev),
           "local_dense_ms": time_call(lambda: dense(*local), dev)}
    if cuda:
        res["peak_memory_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30
    per_rank = [None] * world
    dist.all_gather_object(per_rank, res)
    if rank == 0:
        report = {"shape": {"S": S, "H": H, "D": D, "video": list(args.video), "ranks": world, "ratio": args.ratio,
                            "tiling": args.tiling, "dtype": str(q.dtype)},
                  "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
                  "max_abs_diff_vs_one_gpu": float(diff), "per_rank": per_rank,
                  "one_gpu_sparse_ms": time_call(lambda: sparse_attention(q, k, v, layout, cfg), dev),
                  "one_gpu_dense_ms": time_call(lambda: dense(*(t.transpose(1, 2) for t in (q, k, v))), dev)}
        slowest = max(r["ulysses_sparse_ms"] for r in per_rank)
        report["speedup_vs_one_gpu_sparse"] = report["one_gpu_sparse_ms"] / slowest
        report["speedup_vs_ulysses_dense"] = max(r["ulysses_dense_ms"] for r in per_rank) / slowest
        print(json.dumps(report, indent=1), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0
