"""The partition replayed from a CUDA graph kept by the layout.

On the GPU a partition's ~50 small ops per level are bound by host launch overhead, so the
first call of a shape captures them as a CUDA graph (after one warm-up run on a side stream)
and later calls copy their features in and replay it. Graphs live in the layout's `ShapeCache`
(bounded; each holds its input, output and working memory on the GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.registry import Kernels, or_reference
from ..notices import logger
from .cache import ShapeCache
from .reblock_partition import partition
from .reblock_schedule import Schedule

log = logger()


@dataclass
class CapturedPartition:
    """`partition` of a static input `z` captured as a CUDA graph; `schedule` keeps the static
    tensors the graph reads alive."""

    graph: "torch.cuda.CUDAGraph"
    z: torch.Tensor
    out: torch.Tensor
    schedule: Schedule


def capture_partition(z: torch.Tensor, schedule: Schedule, kernels: Kernels) -> CapturedPartition:
    """`partition` of a copy of z captured as a CUDA graph (after one warm-up run on a side stream);
    raises RuntimeError where capture fails."""
    static = z.clone()
    stream = torch.cuda.Stream(z.device)
    stream.wait_stream(torch.cuda.current_stream(z.device))
    with torch.cuda.stream(stream):
        partition(static, schedule, kernels)  # warm-up outside the graph (workspaces, lazy init)
    torch.cuda.current_stream(z.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = partition(static, schedule, kernels)
    return CapturedPartition(graph, static, out, schedule)


def capture_or_none(z: torch.Tensor, schedule: Schedule, kernels: Kernels) -> CapturedPartition | None:
    """`capture_partition`, or None where capture fails (said once, as the result is cached):
    the partition then keeps working eagerly."""
    try:
        return capture_partition(z, schedule, kernels)
    except RuntimeError as e:
        log.warning("reblock: CUDA graph capture failed (%s); running the partition eagerly", e)
        return None


def run_partition(z: torch.Tensor, schedule: Schedule, block_size: int, kernels: Kernels | None = None,
                  cache: ShapeCache | None = None, region: int = 0) -> torch.Tensor:
    """`partition`, replayed on the GPU from a CUDA graph kept in `cache` (the layout's; its ~50
    small ops per level are bound by host launch overhead) per (region, shape, dtype, device,
    block size, kernels); eager without a cache, off the GPU, where `cache.graphs` is off (calls whose
    shapes are never seen again, such as the kernel warm-up), while the caller is itself capturing,
    or where capture failed (cached as None: said once)."""
    kernels = or_reference(kernels)
    if cache is None or not cache.graphs or not z.is_cuda or torch.cuda.is_current_stream_capturing():
        return partition(z, schedule, kernels)
    key = (region, tuple(z.shape), z.dtype, str(z.device), block_size, kernels.partition_level.family)
    with torch.cuda.device(z.device):
        captured = cache.get("partition_graph", key, lambda: capture_or_none(z, schedule, kernels))
        if captured is None:
            return partition(z, schedule, kernels)
        captured.z.copy_(z)
        captured.graph.replay()
        return captured.out.clone()
