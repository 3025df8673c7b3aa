"""The kernel with nothing skipped against cuDNN (section `probe`).

Every block exact, no tails, at the 5s shape: this separates the cost of the kernel's own loop
from that of sparsity. Rows are gathered by the cube permutation, or read in model order (an
identity permutation, contiguous blocks) at both block sizes.
"""
from __future__ import annotations

import torch

from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.backend.planner import make_tiling
from adaptive_sparse_attention.bench.scenes import h3_qkv
from adaptive_sparse_attention.bench.timing import bench_ms
from adaptive_sparse_attention.kernels.arch import kernel_config
from adaptive_sparse_attention.kernels.plan import BlockSparsePlan, Tiling
from adaptive_sparse_attention.kernels.triton.attention import block_sparse_triton
from kernel_cases import DIM, H3_SHAPES, HEADS


def dense_plan(tiling: Tiling | None, S: int, block_size: int) -> BlockSparsePlan:
    """A plan that computes every block exactly: on `tiling`'s permutation, or (None) on the identity."""
    if tiling is None:
        J = -(-S // block_size)
        slots = torch.arange(J * block_size, device="cuda", dtype=torch.int32)
        perm = torch.where(slots < S, slots, -1).view(1, 1, -1)
        block_len = torch.clamp(S - block_size * torch.arange(J, device="cuda", dtype=torch.int32), max=block_size)
        tiling = Tiling(block_size, perm, perm, block_len)
    else:
        tiling = Tiling(block_size, tiling.q_perm, tiling.q_perm, tiling.block_len)
        J = tiling.num_blocks
    return BlockSparsePlan(tiling, torch.full((J,), J, dtype=torch.int32, device="cuda"),
                           torch.zeros(1, HEADS, J, 0, dtype=torch.int32, device="cuda"),
                           torch.zeros(1, HEADS, J, dtype=torch.int32, device="cuda"))


def dense_probe(results: dict) -> None:
    """Time and throughput of the dense plans and of cuDNN SDPA into results["dense_probe"]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layout = H3_SHAPES["5s"].layout()
    S = layout.total
    q, k, v = h3_qkv(layout, HEADS, DIM, torch.bfloat16, seed=3)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        dense_ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), rep_ms=2000)
    flops = 4 * DIM * HEADS * S * S
    rows = {"S": S, "dense_cudnn_ms": dense_ms, "dense_cudnn_tflops": flops / dense_ms / 1e9}
    cube = make_tiling(q, k, layout, SparseConfig(tiling="cube"))
    for name, bs, tiling in (("cube gather bs64", 64, cube), ("identity bs64", 64, None), ("identity bs128", 128, None)):
        conf = kernel_config(DIM, bs, q.device)
        plan = dense_plan(tiling, S, bs)
        ms = bench_ms(lambda: block_sparse_triton(q, k, v, plan, config=conf), rep_ms=2000)
        rows[name] = {"kernel_ms": ms, "tflops": flops / ms / 1e9, "config": conf.__dict__}
        print(f"dense probe 5s {name}: {ms:.1f} ms {flops / ms / 1e9:.0f} TFLOP/s "
              f"(cuDNN {dense_ms:.1f} ms)", flush=True)
    results["dense_probe"] = rows
