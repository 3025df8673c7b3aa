"""A run's timers: the sparse blocks' attention modules, and the calls timed against the dense attention that
would have run (`run_stats.ShapeTiming`). On CUDA they are events, read once per model call and at the run's end
(`RunTimers.flush`: one host synchronisation), never per block; on the CPU the wall clock, added at once."""
from __future__ import annotations

import time
import torch

from .run_stats import RunStats, ShapeTiming


def mark(x: torch.Tensor) -> object:
    """A point in time on x's device: a CUDA event recorded on the current stream (no host synchronisation),
    else the wall clock."""
    return event() if x.is_cuda else time.perf_counter()


def event() -> torch.cuda.Event:
    """A timing CUDA event recorded now on the current stream."""
    recorded = torch.cuda.Event(enable_timing=True)
    recorded.record()
    return recorded


class RunTimers:
    """The run's CUDA events not read yet; what is read goes into the run's `RunStats` (``attention_ms``,
    ``timings``). Not locked: its `RunTracker` holds its lock around every call."""

    def __init__(self) -> None:
        self.blocks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.timings: list[tuple[tuple, float, str, tuple]] = []

    def stop(self, stats: RunStats, start: object) -> None:
        """The end of a sparse block's attention module that began at `mark` `start`."""
        if isinstance(start, float):
            stats.attention_ms += (time.perf_counter() - start) * 1e3
        else:
            self.blocks.append((start, event()))

    def timing(self, stats: RunStats, key: tuple, share: float, baseline: str,
               marks: tuple[object, object, object]) -> None:
        """One head group of a sparse call timed against dense attention (`RunTracker.note_timing`)."""
        if isinstance(marks[0], float):
            add_timing(stats, key, share, baseline, (marks[1] - marks[0]) * 1e3, (marks[2] - marks[1]) * 1e3)
        else:
            self.timings.append((key, share, baseline, marks))

    def flush(self, stats: RunStats) -> None:
        """Read the recorded events (the host waits for the last of them once; the others are done by then)."""
        for end in [end for _, end in self.blocks] + [marks[2] for *_, marks in self.timings]:
            end.synchronize()
        stats.attention_ms += sum(a.elapsed_time(b) for a, b in self.blocks)
        for key, share, baseline, (a, b, c) in self.timings:
            add_timing(stats, key, share, baseline, a.elapsed_time(b), b.elapsed_time(c))
        self.blocks.clear()
        self.timings.clear()


def add_timing(stats: RunStats, key: tuple, share: float, baseline: str, sparse_ms: float, dense_ms: float) -> None:
    """Add one timed head group to `stats.timings[key]`."""
    timing = stats.timings.setdefault(key, ShapeTiming(baseline=baseline))
    timing.sparse_ms += sparse_ms
    timing.dense_ms += dense_ms
    timing.share += share
