"""One timed row of the kernel on a plan: milliseconds, the pairs it computes, throughput against dense."""
from __future__ import annotations

import torch

from adaptive_sparse_attention.bench.timing import bench_ms
from adaptive_sparse_attention.kernels.arch import KernelConfig
from adaptive_sparse_attention.kernels.plan import BlockSparsePlan
from adaptive_sparse_attention.kernels.triton.attention import block_sparse_triton
from kernel_cases import DIM, computed_pairs


def kernel_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan, conf: KernelConfig,
               dense_ms: float, dense_tflops: float) -> dict:
    """The kernel's time on `plan` with launch config `conf`, its throughput over the pairs it
    computes (exact query-key pairs plus summary columns), and both against dense cuDNN."""
    exact, summary = computed_pairs(plan)
    ms = bench_ms(lambda: block_sparse_triton(q, k, v, plan, config=conf))
    tflops = 4 * DIM * (exact + summary) / ms / 1e9
    return dict(kernel_ms=ms, exact_pairs=exact, summary_pairs=summary, tflops=tflops,
                vs_dense_rate=tflops / dense_tflops, vs_dense_time=ms / dense_ms, config=conf.__dict__)
