"""Time of a callable: device time by CUDA events on a GPU, the wall clock on the CPU (the one timer
the dense chooser and the benchmarks share)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def event_spans(fn: Callable[[], object], reps: int) -> list[float]:
    """Milliseconds of each of `reps` calls of `fn` on the current CUDA stream, every one bracketed
    by CUDA events and waited for (device time; launches are not overlapped with the next call)."""
    spans = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        spans.append(start.elapsed_time(stop))
    return spans


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int = 1, reps: int = 3) -> float:
    """Median milliseconds of `reps` calls of `fn` after `warmup` untimed calls.

    Args:
        fn: the callable (its result is ignored).
        device: where its work runs: CUDA events on a CUDA device (synchronised first), else the wall clock.
        warmup: untimed calls first (compilation, caches).
        reps: timed calls.
    Returns:
        The median, in milliseconds.
    """
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return statistics.median(event_spans(fn, reps))
    spans = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        spans.append((time.perf_counter() - start) * 1e3)
    return statistics.median(spans)
