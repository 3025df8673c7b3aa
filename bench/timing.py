"""Timing of one callable: warm-up calls, then the median of timed repetitions.

On CUDA every repetition is bracketed by CUDA events (device time, no host overhead between
launches counted twice); on the CPU by `time.perf_counter`.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def time_call(fn: Callable[[], object], device: torch.device, warmup: int = 1, reps: int = 3) -> float:
    """Median milliseconds of `reps` calls of `fn` after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
