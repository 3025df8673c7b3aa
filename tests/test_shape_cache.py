"""Shape-only state has an owner: every `SequenceLayout` carries its `ShapeCache` (backend/cache.py).

What a call builds for a layout (kernel resolution, tilings, routing tables, schedules, graphs)
lives in that layout's cache, bounded per job and resettable; nothing is kept by a module.
"""
import logging

import pytest
import torch

from adaptive_sparse_attention import SequenceLayout, SparseConfig, sparse_attention
from adaptive_sparse_attention.backend.cache import JOB_BOUNDS, ShapeCache

SEGMENTS = [(0, 20, "text"), (20, 20 + 2 * 8 * 8, "video", (2, 8, 8))]


def test_each_job_is_bounded_and_the_cache_resets():
    cache = ShapeCache()
    built = []
    for i in range(JOB_BOUNDS["route_plan"] + 3):
        cache.get("route_plan", i, lambda i=i: built.append(i) or i)
    assert len(cache) == JOB_BOUNDS["route_plan"]
    assert cache.get("route_plan", JOB_BOUNDS["route_plan"] + 2, lambda: -1) == JOB_BOUNDS["route_plan"] + 2
    assert cache.get("route_plan", 0, lambda: "rebuilt") == "rebuilt"  # the oldest went first
    cache.notices.say("said")
    cache.clear()
    assert len(cache) == 0
    assert not cache.notices
    with pytest.raises(ValueError, match="job='tilings' is not allowed"):
        cache.get("tilings", 0, lambda: 0)


def test_the_layout_owns_what_a_call_builds():
    a, b = SequenceLayout.from_segments(SEGMENTS), SequenceLayout.from_segments(SEGMENTS)
    assert a == b
    assert hash(a) == hash(b)
    assert a.cache is not b.cache  # the cache is not part of the value
    q, k, v = (torch.randn(1, 2, a.total, 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    config = SparseConfig(kernel="torch", min_tokens=0, topk_ratio=0.3)
    out = sparse_attention(q, k, v, a, config)
    assert {"kernels", "reblock_static", "route_plan", "tube_statics"} <= set(a.cache.jobs)
    assert len(b.cache) == 0
    again = sparse_attention(q, k, v, a, config)
    assert torch.equal(out, again)
    a.cache.clear()
    assert torch.equal(sparse_attention(q, k, v, a, config), out)  # rebuilt alike


def test_a_fallback_is_said_once_per_layout(caplog):
    layout = SequenceLayout.from_segments(SEGMENTS)
    q, k, v = (torch.randn(1, 2, layout.total, 32, dtype=torch.float64) for _ in range(3))
    config = SparseConfig(kernel="cudnn", min_tokens=0, tiling="cube")
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        for _ in range(3):
            sparse_attention(q, k, v, layout, config)
        sparse_attention(q, k, v, SequenceLayout.from_segments(SEGMENTS), config)
    said = [r for r in caplog.records if "kernel='cudnn' cannot run" in r.getMessage()]
    assert len(said) == 2  # once for each layout
