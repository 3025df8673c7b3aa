"""Build a call's Triton kernels side by side on threads before the call runs.

Triton builds a kernel the first time a launch asks for it, one after the other: a cold sparse call of
H3's shape builds a few dozen, each its own MLIR, LLVM and ptxas work (BENCHMARKS.md has the times). A
dry run of the call with Triton's ``jit_cache_hook`` declining every build records what each launch asks
for and skips the launch (the dry run's results are garbage and dropped). The records then build on a
pool of threads through `JITFunction.preload`, Triton's own path for a recorded specialisation (the same
cache keys, in memory and on disk); Triton's compiler leaves the GIL to its passes and to ptxas, so the
builds run side by side. The call itself then finds every kernel built.

A kernel built before the dry run would launch on unset buffers: Triton's ``launch_enter_hook`` ends
the dry run at its first real launch instead (what it recorded until then still builds). Torch's
operations in a dry run also compute on unset buffers, which may trip a device assertion and end the
process's CUDA context, so this runs only in processes that exist to prepare (``install.py prepare``,
the warm-start child), never in ComfyUI's.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ...notices import logger

log = logger()


class Launched(RuntimeError):
    """A dry run reached a kernel built already: it would have run on unset buffers."""


class NotInMemory(RuntimeError):
    """A launch under `in_memory_only` asked for a kernel this process does not hold."""


@dataclass(frozen=True)
class Build:
    """One kernel specialisation a launch asked for: the JIT function and Triton's serialised
    specialisation (`JITFunction.preload`'s input)."""

    kernel: Any
    data: str


def triton_knobs():
    """Triton's runtime knobs where this Triton has the hooks a dry run needs (3.4 and later), else None."""
    import triton

    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not all(hasattr(runtime, h) for h in ("jit_cache_hook", "launch_enter_hook")):
        return None
    return knobs


def record_builds(call: Callable[[], object], knobs) -> tuple[list[Build], str | None]:
    """Run `call` with every Triton build declined (its launches skipped) and a real launch refused.

    Args:
        call: the call whose kernels are wanted.
        knobs: `triton_knobs()`.
    Returns:
        The builds asked for, in order, and why the dry run ended early (None when it ran through).
    """
    builds: dict[tuple[int, str], Build] = {}

    def decline(*, key, fn, compile, **_) -> bool:
        builds.setdefault((id(fn.jit_function), str(key)), Build(fn.jit_function, compile["specialization_data"]))
        return True  # no build, no launch

    def refuse(*_) -> None:
        raise Launched("a kernel built before the dry run would have launched on its unset buffers")

    saved = knobs.runtime.jit_cache_hook, knobs.runtime.launch_enter_hook
    knobs.runtime.jit_cache_hook, knobs.runtime.launch_enter_hook = decline, refuse
    try:
        call()
        ended = None
    except Exception as err:  # the dry run's garbage may make it stop anywhere: what it recorded still builds
        ended = f"{type(err).__name__}: {err}"
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.launch_enter_hook = saved
    return list(builds.values()), ended


def holds_compiled(fn: Any, device_index: int) -> bool:
    """Whether the Triton JIT function `fn` holds a compiled kernel for CUDA device `device_index` in this
    process's memory (its per-device cache, read without creating an entry). False where this Triton keeps
    that cache elsewhere: the caller then does what it does for a process that holds nothing.

    Args:
        fn: a ``triton.jit`` function.
        device_index: the CUDA device's index.
    """
    caches = getattr(fn, "device_caches", None)
    entry = caches.get(device_index) if isinstance(caches, dict) else None
    return isinstance(entry, tuple) and isinstance(entry[0], dict) and bool(entry[0])


@contextmanager
def in_memory_only(knobs) -> Iterator[None]:
    """While inside, a Triton launch of a kernel not in this process's memory raises `NotInMemory` instead of
    loading it from the disk cache or building it (Triton's ``jit_cache_hook`` runs only on such a miss).
    The hook is Triton's, process-wide: only for a short call on the thread that runs the model.

    Args:
        knobs: `triton_knobs()`.
    """
    def refuse(*, fn, **_) -> bool:
        raise NotInMemory(f"the Triton kernel {getattr(fn, 'name', fn)} is not in this process's memory")

    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = refuse
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = saved


def build_all(builds: list[Build], device: torch.device, threads: int) -> None:
    """Build every record on `threads` threads (each on `device`), raising the first failure."""
    def build(b: Build) -> None:
        with torch.cuda.device(device):
            b.kernel.preload(b.data)

    with ThreadPoolExecutor(max_workers=min(threads, len(builds))) as pool:
        for _ in pool.map(build, builds):
            pass


def build_ahead(call: Callable[[], object], device: torch.device, threads: int) -> int | None:
    """Build the Triton kernels `call` would build, side by side, ahead of running it.

    Args:
        call: a dry run of the call (its results are dropped): Q/K/V and buffers of the real call's shapes.
        device: the CUDA device the kernels are for.
        threads: builds at once (1 or more).
    Returns:
        The kernels built, or None where this Triton has no hooks for a dry run (the real call then builds
        them as it launches, one after the other).
    """
    knobs = triton_knobs()
    if knobs is None:
        log.info("adaptive sparse attention: this Triton has no build hooks (before 3.4): the kernels build one "
                 "after the other")
        return None
    start = time.perf_counter()
    builds, ended = record_builds(call, knobs)
    if ended is not None:
        log.info("adaptive sparse attention: the dry run ended early (%s); %d kernels recorded, the rest build as "
                 "the call launches them", ended, len(builds))
    recorded = time.perf_counter()
    if builds:
        build_all(builds, device, threads)
    log.info("adaptive sparse attention: %d kernels built side by side in %.1f s (dry run %.1f s)", len(builds),
             time.perf_counter() - start, recorded - start)
    return len(builds)
