"""Weights and allocations through ComfyUI: casting (LoRA, offload, quantised weights), the
allocation graph, and KJNodes' low-VRAM calling conventions."""
from __future__ import annotations

import itertools
import sys
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch


@contextmanager
def linear_weights(module: torch.nn.Module, like: torch.Tensor) -> Iterator[tuple[torch.Tensor, Any]]:
    """(weight, bias) of a Linear in `like`'s dtype and device.

    ComfyUI layers go through `comfy.ops.cast_bias_weight`, which dequantises, applies LoRA
    weight functions and handles offloaded weights; plain torch layers are cast directly.
    """
    if not hasattr(module, "comfy_cast_weights"):
        bias = None if module.bias is None else module.bias.to(like)
        yield module.weight.to(like), bias
        return
    import comfy.ops

    if not hasattr(comfy.ops, "CastBiasWeightContext"):  # older ComfyUI: no offload-aware context yet
        yield comfy.ops.cast_bias_weight(module, like)
        return
    with comfy.ops.CastBiasWeightContext(module, like, offloadable=True) as (weight, bias):
        yield weight, bias


def outside_allocation_graph() -> Any:
    """A context that keeps our allocations out of ComfyUI's allocation graph, where it has one.

    Current ComfyUI records the allocations of an H3 forward on CUDA and replays them
    (``comfy.model_prefetch.pause_malloc_graph``, its "model compiler"); its own sparse node pauses
    that for what outlives a call. The engine keeps tiling, routing and reblock tensors across
    calls, so the whole sparse path and the kernel preparation run paused. Older ComfyUI has no
    such graph, and under torch.compile there is nothing to pause at trace time.
    """
    pause = getattr(sys.modules.get("comfy.model_prefetch"), "pause_malloc_graph", None)
    if pause is None or torch.compiler.is_compiling():
        return nullcontext()
    return pause()


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small parameter (norm weight) on `device`, through ComfyUI's cast when it is loaded."""
    mm = sys.modules.get("comfy.model_management")
    return mm.cast_to(t, device=device) if mm is not None else t.to(device)


def head_groups(heads: int, chunks: Any) -> list[tuple[int, int]]:
    """Split heads into `chunks` near-equal groups (KJNodes' ``minimax_head_chunks``)."""
    n = max(1, min(int(chunks) if isinstance(chunks, int) else 1, heads))
    sizes = [heads // n + (1 if i < heads % n else 0) for i in range(n)]
    bounds = list(itertools.accumulate([0] + sizes))
    return list(zip(bounds[:-1], bounds[1:]))



def unwrap_input(x: Any) -> torch.Tensor:
    """KJNodes' low-VRAM block forward hands the attention input in a one-item list to free it early."""
    return x.pop() if isinstance(x, list) else x


