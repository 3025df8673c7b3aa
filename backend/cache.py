"""Bounded caches of objects derived from shapes, and `ShapeCache`, the one store a layout owns.

Layouts, tilings, schedules, routing plans, captured partitions and kernel resolutions depend
only on the sequence's shape (and the device, dtype, block size they were built for), so they
are built once and reused. Each `SequenceLayout` carries its own `ShapeCache`: whoever holds
the layout (the node's per-model layout cache, or an API user) owns what was built for it, and
dropping or `clear()`-ing the layout frees it. Bounds keep memory from growing when one layout
sees many devices, dtypes or block sizes.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

from ..errors import SparseAttentionError
from ..notices import Notices

T = TypeVar("T")

# entries kept per job of a `ShapeCache` (the oldest goes first); graphs hold GPU memory
JOB_BOUNDS = {"kernels": 8, "cube_tiling": 4, "route_plan": 8, "tube_statics": 4, "reblock_static": 4,
              "partition_graph": 4, "metric_graph": 4, "prepared": 4, "sparse_choices": 1, "no_fast_kernel": 8}


class BoundedCache(Generic[T]):
    """Least-recently-used map of at most `size` entries, each built on its first `get`."""

    def __init__(self, size: int):
        self.size = size
        self.entries: "OrderedDict[Hashable, T]" = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        """The cached value of `key`, built by `build()` on a miss (evicting the oldest past `size`)."""
        if key not in self.entries:
            self.entries[key] = build()
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        return self.entries[key]

    def __len__(self) -> int:
        return len(self.entries)


class ShapeCache:
    """What was built for one layout, per job (`JOB_BOUNDS`), and the once-only record of what
    was said about it (`notices`: fallbacks logged once per layout, not once per call). `graphs`
    off: nothing is captured as a CUDA graph (a scratch layout for shapes never seen again). A layout may be
    shared by threads (the clones of one model sampling on several GPUs): an entry is built under a lock,
    once."""

    def __init__(self, graphs: bool = True) -> None:
        self.lock = threading.RLock()  # re-entrant: a build may get other entries of the same layout
        self.jobs: dict[str, BoundedCache] = {}
        self.notices = Notices()
        self.graphs = graphs  # whether the tiling's small-op stages for this layout are captured and replayed as CUDA graphs

    def get(self, job: str, key: Hashable, build: Callable[[], T]) -> T:
        """The entry of `job` for `key` (what it depends on: device, dtype, block size, ...), built on a miss."""
        if job not in JOB_BOUNDS:
            raise SparseAttentionError(f"ShapeCache: job={job!r} is not allowed: expected one of {', '.join(JOB_BOUNDS)}")
        with self.lock:
            cache = self.jobs.get(job)
            if cache is None:
                cache = self.jobs[job] = BoundedCache(JOB_BOUNDS[job])
            return cache.get(key, build)

    def has(self, job: str, key: Hashable) -> bool:
        """Whether `job` holds an entry for `key`."""
        return job in self.jobs and key in self.jobs[job].entries

    def clear(self) -> None:
        """Drop every entry and the record of what was said."""
        self.jobs.clear()
        self.notices.clear()

    def __len__(self) -> int:
        return sum(len(c) for c in self.jobs.values())
