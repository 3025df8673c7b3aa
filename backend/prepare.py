"""Kernel preparation: one synchronous call per layout, in this process, before its first sparse step.

The Triton kernels specialise only on what a clip length cannot change (dtype, head size, block size,
config), on a few buckets of row widths and, where a launch picks its chunk by how many programs it has,
on the head count. So one call with the real layout and head count, and one of the QKV producer's
epilogue, launch every kernel the sparse steps will launch: each loads from Triton's disk cache or, the
first time on a machine, compiles (`install.py prepare` fills the cache ahead). Q/K/V are one random head
expanded over the heads (one head's memory). What compiled and what loaded is counted through Triton's
compilation listener and said with the seconds; the layout records it, so it runs once per layout.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Callable, Iterator

import torch

from ..kernels.registry import Kernels
from ..notices import logger
from .attention import sparse_attention
from .config import SparseConfig
from .layout import SequenceLayout
from .planner import layout_kernels

log = logger()
SCHEDULE_FIELDS = ("warmup_mode", "warmup_ratio", "dense_layers", "min_tokens", "strict", "dense_attention", "plan_reuse",
                   "measure_error", "error_target")


def kernel_fields(config: SparseConfig) -> tuple:
    """The values of `config` that decide which kernels a sparse call launches (every field but
    the schedule-only ones): configs that launch the same kernels map to one value."""
    return tuple((f.name, getattr(config, f.name)) for f in fields(config) if f.name not in SCHEDULE_FIELDS)


def preparation_key(config: SparseConfig, dtype: torch.dtype, device: torch.device, head_dim: int,
                    heads: int) -> tuple:
    """What a layout's preparation is recorded under (job "prepared"): the kernel-deciding config
    fields, dtype, device, head size and count."""
    return (kernel_fields(config), dtype, str(device), head_dim, heads)


def to_prepare(layout: SequenceLayout, config: SparseConfig, dtype: torch.dtype, device: torch.device,
               head_dim: int, heads: int) -> tuple[Kernels, tuple] | None:
    """(the call's kernels, the preparation key) while the layout has kernels to prepare: its kernel family
    compiles and this process has not prepared it yet; None otherwise."""
    kernels = layout_kernels(layout, config, device, dtype, head_dim)
    key = preparation_key(config, dtype, device, head_dim, heads)
    if not kernels.compiles or layout.cache.has("prepared", key):
        return None
    return kernels, key


@dataclass
class Builds:
    """Triton kernels a preparation loaded from the disk cache and compiled (`counting_builds`)."""

    loaded: int = 0
    compiled: int = 0
    first_compile: Callable[[], None] | None = None  # called once, when the first kernel had to compile

    def __call__(self, *, cache_hit: bool, **_) -> None:
        if cache_hit:
            self.loaded += 1
            return
        self.compiled += 1
        if self.compiled == 1 and self.first_compile is not None:
            self.first_compile()


@contextmanager
def counting_builds(first_compile: Callable[[], None] | None = None) -> Iterator[Builds]:
    """While inside, Triton's compilation listener counts what loads from its disk cache and what
    compiles (process-wide: used around one synchronous preparation on the thread that runs the model).
    Without Triton, or a Triton without the listener, nothing is counted."""
    builds = Builds(first_compile=first_compile)
    try:
        import triton
        compilation = triton.knobs.compilation
        saved = compilation.listener
    except (ImportError, AttributeError):
        yield builds
        return
    compilation.listener = builds
    try:
        yield builds
    finally:
        compilation.listener = saved


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


def prepare(layout: SequenceLayout, config: SparseConfig, dtype: torch.dtype, device: torch.device,
            head_dim: int, heads: int, announce: Callable[[str], None] | None = None) -> float | None:
    """Load (or, the first time on a machine, compile) every kernel a sparse call of this shape launches.

    Nothing runs when the call's kernel family compiles nothing (the torch reference) or the layout was
    prepared already. A compile is said when the first kernel has to compile (WARNING: it takes seconds to
    a minute), and the end with its seconds and counts.

    Args:
        layout: the packed-sequence layout the sparse steps will see.
        config: their configuration (its kernel family is resolved here: strict raises when it cannot run).
        dtype, device, head_dim, heads: of their Q/K/V ([B, heads, S, head_dim]).
        announce: also shows the messages (e.g. as progress text on ComfyUI's running node).
    Returns:
        Seconds spent, or None when nothing was to do.
    """
    pending = to_prepare(layout, config, dtype, device, head_dim, heads)
    if pending is None:
        return None
    kernels, key = pending
    say = announce or (lambda message: None)

    def compiling() -> None:
        message = (f"adaptive sparse attention: compiling the sparse-attention kernels for this GPU "
                   f"({layout.total} tokens, {str(dtype).removeprefix('torch.')}, head_dim {head_dim}): once per "
                   "machine, from half a minute to a minute; `python install.py prepare` in the pack's folder "
                   "(ComfyUI-Manager's install step runs it) does this ahead")
        log.warning("%s", message)
        say(message)

    def run() -> float:
        say(f"adaptive sparse attention: preparing the sparse-attention kernels for {layout.total} tokens")
        with counting_builds(compiling) as builds:
            seconds = launch_all(layout, config, dtype, device, head_dim, heads, kernels)
        message = (f"adaptive sparse attention: kernels ready in {seconds:.2f} s ({builds.compiled} compiled, "
                   f"{builds.loaded} loaded from Triton's cache)")
        log.log(30 if builds.compiled else 20, "%s", message)
        say(message)
        return seconds

    return layout.cache.get("prepared", key, run)


def launch_all(layout: SequenceLayout, config: SparseConfig, dtype: torch.dtype, device: torch.device,
               head_dim: int, heads: int, kernels: Kernels) -> float:
    """One call of every kernel a sparse step of this shape launches (`prepare`'s work), synchronised.
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
    epilogue(kernels, heads, head_dim, dtype, device, g)
    sparse_attention(q, k, v, scratch, config)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # once per layout: the time is reported
    return time.perf_counter() - start
