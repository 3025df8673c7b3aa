"""Kernel preparation ahead of the first sparse step: compile once, announce it, keep it out of steps.

The Triton kernels specialise only on what a clip length cannot change (dtype, head size, block
size, config), on buckets of row widths (three per power of two for the radix-select rows, the power
of two for the reblock levels) and, where a launch picks its chunk by how many programs it has (the
reblock split's wide levels), on the head count. So one call with the real layout and head count, and
one of the QKV producer's epilogue, compile every kernel the sparse steps will launch; its Q/K/V are
one random head expanded over the heads (one head's memory), its buffers those of a sparse call of the
block.
The node runs it at the first block call of a layout (a dense warmup step in the default schedule),
after saying so; Triton keeps what it compiled in its on-disk cache for later processes, and `python
-m adaptive_sparse_attention prepare` fills that cache ahead.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import fields
from typing import Callable

import torch

from ..kernels.registry import Kernels
from ..kernels.triton.build_ahead import NotInMemory, build_ahead, in_memory_only, triton_knobs
from ..notices import logger
from .attention import sparse_attention
from .config import SparseConfig
from .layout import SequenceLayout
from .planner import layout_kernels

log = logger()
SCHEDULE_FIELDS = ("warmup_mode", "warmup_ratio", "dense_layers", "min_tokens", "strict", "dense_attention", "plan_reuse")


def kernel_fields(config: SparseConfig) -> tuple:
    """The values of `config` that decide which kernels a sparse call launches (every field but
    the schedule-only ones): configs that launch the same kernels map to one value."""
    return tuple((f.name, getattr(config, f.name)) for f in fields(config) if f.name not in SCHEDULE_FIELDS)


def first_use_message(layout: SequenceLayout, dtype: torch.dtype, head_dim: int) -> str:
    """What the user reads before the kernels of a new shape are prepared (the wait comes next)."""
    return (f"adaptive sparse attention: preparing the sparse-attention kernels for {layout.total} tokens "
            f"({str(dtype).removeprefix('torch.')}, head_dim {head_dim}) before the first sparse step. The first "
            "time on a machine Triton compiles them, which takes from half a minute to a minute; later runs load them from "
            "Triton's cache in seconds. `python install.py prepare`, run in the pack's folder with ComfyUI's "
            "Python (or ComfyUI-Manager's install step), does this ahead.")


def preparation_key(config: SparseConfig, dtype: torch.dtype, device: torch.device, head_dim: int,
                    heads: int) -> tuple:
    """What a layout's preparation is recorded under in its cache (job "prepared"): the kernel-deciding
    config fields, dtype, device, head size and count."""
    return (kernel_fields(config), dtype, str(device), head_dim, heads)


def prepared(layout: SequenceLayout, config: SparseConfig, dtype: torch.dtype, device: torch.device,
             head_dim: int, heads: int) -> bool:
    """Whether this process prepared the layout's kernels already (`prepare_kernels`' record)."""
    return layout.cache.has("prepared", preparation_key(config, dtype, device, head_dim, heads))


def to_prepare(layout: SequenceLayout, config: SparseConfig, dtype: torch.dtype, device: torch.device,
               head_dim: int, heads: int) -> tuple[Kernels, tuple] | None:
    """(the call's kernels, the preparation key) while the layout has kernels to prepare: its kernel family
    compiles and this process has not prepared it yet; None otherwise."""
    kernels = layout_kernels(layout, config, device, dtype, head_dim)
    key = preparation_key(config, dtype, device, head_dim, heads)
    if not kernels.compiles or layout.cache.has("prepared", key):
        return None
    return kernels, key


def epilogue(kernels: Kernels, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
             g: torch.Generator) -> None:
    """One call of the QKV producer's epilogue (`Kernels.norm_rope`) on a few random rows of `heads` heads,
    with a rotation table in the model's dtype as H3's is (its width is no specialisation of the kernel):
    the kernel a sparse step launches first."""
    rows, half = 16, max(1, head_dim // 4)
    chunk = torch.randn(rows, 3 * heads * head_dim, generator=g, device=device, dtype=dtype)
    table = torch.randn(1, rows, 1, half, 2, 2, generator=g, device=device, dtype=dtype)
    scale = torch.ones(head_dim, device=device, dtype=dtype)
    out = [torch.empty(1, heads, rows, head_dim, device=device, dtype=dtype) for _ in range(3)]
    kernels.norm_rope(chunk, *out, 0, table, scale, scale, 1e-6)


def prepare_kernels(layout: SequenceLayout, config: SparseConfig, dtype: torch.dtype, device: torch.device,
                    head_dim: int, heads: int, announce: Callable[[str], None] | None = None,
                    build_threads: int = 0) -> float | None:
    """Compile (or load from Triton's cache) every kernel a sparse call of this shape launches.

    Nothing runs when the call's kernel family compiles nothing (the torch reference) or the layout was
    prepared already; otherwise the wait is announced before it starts.

    Args:
        layout: the packed-sequence layout the sparse steps will see.
        config: their configuration (its kernel family is resolved here: strict raises when it cannot run).
        dtype, device, head_dim, heads: of their Q/K/V ([B, heads, S, head_dim]).
        announce: also shows the message before the wait (e.g. in ComfyUI's UI); it is always logged.
        build_threads: 0: each Triton kernel builds at its first launch, one after the other. n > 0 (CUDA
            only; a process that exists to prepare, `kernels/triton/build_ahead.py` says why): a dry run of the
            call at the Triton family records the builds, n threads run them side by side, then the call runs.
    Returns:
        Seconds spent, or None when nothing was to do.
    """
    pending = to_prepare(layout, config, dtype, device, head_dim, heads)
    if pending is None:
        return None
    kernels, key = pending

    def run() -> float:
        message = first_use_message(layout, dtype, head_dim)
        log.warning("%s", message)
        if announce is not None:
            announce(message)
        seconds = launch_all(layout, config, dtype, device, head_dim, heads, kernels, build_threads)
        log.info("adaptive sparse attention: kernels ready in %.1f s", seconds)
        return seconds

    return layout.cache.get("prepared", key, run)


def prepare_from_memory(layout: SequenceLayout, config: SparseConfig, dtype: torch.dtype, device: torch.device,
                        head_dim: int, heads: int) -> float | None:
    """`prepare_kernels` on a CUDA device where this process holds every Triton kernel the call launches
    already (a model patched again with other widgets, a clip length of known row buckets): nothing to
    announce, no child to start. Triton is told to stop the call at the first kernel not in its memory
    (`kernels/triton/build_ahead.in_memory_only`), before it loads or builds anything.

    Returns:
        Seconds spent, the layout then recorded as prepared; None where a kernel was not in memory (nothing
        recorded: the caller starts a child or prepares as before), the device is no CUDA GPU, the kernels
        compile nothing, the layout was prepared already, or this Triton has no hook to tell.
    """
    pending = None if device.type != "cuda" else to_prepare(layout, config, dtype, device, head_dim, heads)
    knobs = None if pending is None else triton_knobs()
    if knobs is None:
        return None
    kernels, key = pending

    def run() -> float:
        with in_memory_only(knobs):
            seconds = launch_all(layout, config, dtype, device, head_dim, heads, kernels)
        log.info("adaptive sparse attention: kernels ready in %.2f s (every one in this process's memory)", seconds)
        return seconds

    try:
        return layout.cache.get("prepared", key, run)
    except NotInMemory as err:
        log.info("adaptive sparse attention: %s", err)
        return None


def holds_kernels(device: torch.device) -> bool:
    """Whether this process ran a sparse step (or a preparation) on CUDA `device` already: the QKV producer's
    Triton epilogue, the first kernel a sparse step launches, is in Triton's memory for it. A model patched
    again in such a process then prepares from memory at its first warmup step (`prepare_from_memory`).
    False off CUDA, before this process initialised CUDA, without Triton, or where Triton keeps its cache where
    `holds_compiled` does not look."""
    if device.type != "cuda" or not torch.cuda.is_initialized() or importlib.util.find_spec("triton") is None:
        return False
    from ..kernels.triton.norm_rope import in_memory

    return in_memory(device.index if device.index is not None else torch.cuda.current_device())


def launch_all(layout: SequenceLayout, config: SparseConfig, dtype: torch.dtype, device: torch.device,
               head_dim: int, heads: int, kernels: Kernels, build_threads: int = 0) -> float:
    """One call of every kernel a sparse step of this shape launches (`prepare_kernels`' work), synchronised.
    Returns its seconds, timed from an idle device: GPU work queued before it (a model call's earlier layers)
    is waited for first and not counted, so the time reported is the preparation's own."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    g = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(1, 1, layout.total, head_dim, generator=g, device=device, dtype=dtype)
               .expand(1, heads, layout.total, head_dim) for _ in range(3))
    scratch = SequenceLayout(layout.segments)  # what this call builds goes with it
    scratch.cache.graphs = False  # no CUDA graph for a shape never seen again
    scratch.cache.notices = layout.cache.notices  # what it says is said once for the layout
    if build_threads and device.type == "cuda":
        dry = SequenceLayout(layout.segments)  # what the dry run caches (from unset buffers) goes with it
        dry.cache.graphs, dry.cache.notices = False, layout.cache.notices
        build_ahead(lambda: (sparse_attention(q, k, v, dry, config.replace(kernel="triton")),
                             epilogue(kernels, heads, head_dim, dtype, device, g)), device, build_threads)
    epilogue(kernels, heads, head_dim, dtype, device, g)
    sparse_attention(q, k, v, scratch, config)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # once per layout: the time is reported
    return time.perf_counter() - start
