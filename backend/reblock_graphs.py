"""The reblock tiling's small-op stages replayed from CUDA graphs kept by the layout.

On the GPU two stages of the tiling are chains of small ops bound by host launch overhead: the
partition (~50 per level) and the metric's factor and basis (~150: float64 Cholesky factorizations and
triangular solves on [D, D] matrices per head). The first call of a shape captures such a stage as a
CUDA graph (after one warm-up run on a side stream) and later calls copy their input in and replay
it: one launch instead of the chain. Graphs live in the layout's `ShapeCache` (bounded; each holds
its input, output and working memory on the GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from ..kernels.registry import Kernels, or_reference
from ..notices import logger
from .cache import ShapeCache
from .reblock_partition import partition
from .reblock_schedule import Schedule

log = logger()


@dataclass
class Captured:
    """`fn` of a static input `x` captured as a CUDA graph; `fn` keeps what the graph reads alive."""

    graph: "torch.cuda.CUDAGraph"
    x: torch.Tensor
    out: torch.Tensor
    fn: Callable[[torch.Tensor], torch.Tensor]


def capture(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Captured:
    """`fn` of a copy of x captured as a CUDA graph (after one warm-up run on a side stream);
    raises RuntimeError where capture fails."""
    static = x.clone()
    stream = torch.cuda.Stream(x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        fn(static)  # warm-up outside the graph (workspaces, lazy init)
    torch.cuda.current_stream(x.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn(static)
    return Captured(graph, static, out, fn)


def capture_or_none(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, what: str) -> Captured | None:
    """`capture`, or None where capture fails (said once, as the result is cached): `what` then keeps
    running eagerly."""
    try:
        return capture(fn, x)
    except RuntimeError as e:
        log.warning("reblock: CUDA graph capture of the %s failed (%s); running it eagerly", what, e)
        return None


def replayed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, cache: ShapeCache | None,
             name: str, key: Hashable) -> torch.Tensor:
    """`fn(x)`, replayed on the GPU from a CUDA graph kept in `cache` under (`name`, key, x's shape, dtype and
    device); eager without a cache, off the GPU, where `cache.graphs` is off (calls whose shapes are never
    seen again, such as the kernel warm-up), while the caller is itself capturing, or where capture failed
    (cached as None: said once). `fn` must be a function of x and of what `key` names only."""
    if cache is None or not cache.graphs or not x.is_cuda or torch.cuda.is_current_stream_capturing():
        return fn(x)
    with torch.cuda.device(x.device):
        captured = cache.get(name, (key, tuple(x.shape), x.dtype, str(x.device)),
                             lambda: capture_or_none(fn, x, name.replace("_", " ")))
        if captured is None:
            return fn(x)
        captured.x.copy_(x)
        captured.graph.replay()
        return captured.out.clone()


def run_partition(z: torch.Tensor, schedule: Schedule, block_size: int, kernels: Kernels | None = None,
                  cache: ShapeCache | None = None, region: int = 0) -> torch.Tensor:
    """`partition` of z, replayed from a CUDA graph kept in `cache` (the layout's) per (region, shape,
    dtype, device, block size, kernels) where `replayed` can."""
    kernels = or_reference(kernels)
    return replayed(lambda x: partition(x, schedule, kernels), z, cache, "partition_graph",
                    (region, block_size, kernels.partition_level.family))
