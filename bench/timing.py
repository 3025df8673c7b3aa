"""Timing of one callable: `time_call` (the pack's `timer.median_ms`: warm-up calls, then the median
of timed repetitions, by CUDA events on a GPU, by the wall clock on the CPU). `bench_ms` is Triton's `do_bench`
(it flushes the L2 cache between calls), for kernels timed on their own. `queued_ms` times a callable's
device work alone: its launches are queued behind a busy GPU, as inside a model's forward pass
where the host runs ahead of the GPU, so gaps while the host enqueues many small kernels do not
count.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ..timer import median_ms as time_call  # the pack's one timer, under the benchmarks' name


def queued_ms(fn: Callable[[], object], device: torch.device, warmup: int = 1, reps: int = 3,
              lead_ms: float = 100.0) -> tuple[float, float]:
    """(median device milliseconds of `fn` with its launches queued behind `lead_ms` of GPU spin,
    the longest host enqueue time seen). If the host took longer than the lead, the GPU waited
    for it and the time includes host gaps: callers should check the second value."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    stop.record()
    stop.synchronize()
    cycles = int(10_000_000 * lead_ms / start.elapsed_time(stop))
    times, host = [], 0.0
    for _ in range(reps):
        torch.cuda.synchronize(device)
        torch.cuda._sleep(cycles)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        stop.record()
        host = max(host, (time.perf_counter() - t0) * 1e3)
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times), host


def bench_ms(fn: Callable[[], object], rep_ms: float = 1500) -> float:
    """Median milliseconds of `fn` by `triton.testing.do_bench` (100 ms warm-up, `rep_ms` of
    repetitions, CUDA only; imports Triton when called)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=100, rep=rep_ms, return_mode="median"))
