"""`BoundedCache`: a small least-recently-used map for objects derived from shapes.

Layouts, tilings and schedules depend only on the sequence's shape, so they are built once and
reused; the bound keeps memory from growing when a session sees many shapes.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

T = TypeVar("T")


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
