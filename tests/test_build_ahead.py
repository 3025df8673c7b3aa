"""Triton kernels built side by side ahead of a call (`kernels/triton/build_ahead.py`): the dry run records each
specialisation once and skips its launch, refuses to launch a kernel built already, always puts Triton's hooks
back, and on a GPU leaves the real call nothing to build. On the CPU the hooks are driven by a stand-in for
Triton's launch path; on a GPU the real one runs in a fresh process with an empty cache."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from adaptive_sparse_attention.kernels.triton import build_ahead as ba


def fake_knobs():
    return SimpleNamespace(runtime=SimpleNamespace(jit_cache_hook=None, launch_enter_hook=None))


def launcher(knobs, built: set, ran: list):
    """A stand-in for Triton's launch path: an unbuilt specialisation asks the build hook first (True: no
    build, no launch); a built one calls the launch hook, then runs."""
    def launch(kernel, key: str) -> None:
        if (kernel, key) not in built:
            hook = knobs.runtime.jit_cache_hook
            if hook is not None and hook(key=key, repr="", fn=SimpleNamespace(jit_function=kernel, name=kernel),
                                         compile={"specialization_data": f"{kernel}:{key}"},
                                         is_manual_warmup=False, already_compiled=False):
                return
            built.add((kernel, key))
        if knobs.runtime.launch_enter_hook is not None:
            knobs.runtime.launch_enter_hook({})
        ran.append((kernel, key))
    return launch


def test_a_dry_run_records_each_build_once_in_order_and_launches_nothing():
    knobs, built, ran = fake_knobs(), set(), []
    launch = launcher(knobs, built, ran)

    def call():
        for kernel, key in (("gram", "a"), ("split", "w1"), ("gram", "a"), ("split", "w2"), ("attention", "a")):
            launch(kernel, key)

    builds, ended = ba.record_builds(call, knobs)
    assert [b.data for b in builds] == ["gram:a", "split:w1", "split:w2", "attention:a"]
    assert ended is None and ran == [] and built == set()
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.launch_enter_hook is None


def test_a_dry_run_stops_before_a_kernel_built_already_and_keeps_what_it_recorded():
    knobs, ran = fake_knobs(), []
    launch = launcher(knobs, {("split", "w1")}, ran)
    builds, ended = ba.record_builds(lambda: [launch("gram", "a"), launch("split", "w1"), launch("tail", "a")], knobs)
    assert [b.data for b in builds] == ["gram:a"]
    assert ran == []  # the built kernel did not run on the dry run's unset buffers
    assert ended.startswith("Launched: a kernel built before the dry run")


def test_hooks_are_put_back_after_a_dry_run_that_raises():
    knobs = fake_knobs()
    before = (lambda **_: False, lambda _: None)
    knobs.runtime.jit_cache_hook, knobs.runtime.launch_enter_hook = before

    def call():
        raise IndexError("index 7 is out of bounds for dimension 0 with size 3")

    builds, ended = ba.record_builds(call, knobs)
    assert builds == [] and ended == "IndexError: index 7 is out of bounds for dimension 0 with size 3"
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.launch_enter_hook) == before


def test_without_build_hooks_the_kernels_build_as_they_launch(monkeypatch, caplog):
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "knobs", None, raising=False)
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        assert ba.build_ahead(lambda: pytest.fail("no dry run without hooks"), torch.device("cuda"), 4) is None
    assert any("no build hooks" in r.getMessage() for r in caplog.records)


REAL_RUN = """
import json, torch
from adaptive_sparse_attention import SequenceLayout, SparseConfig, sparse_attention
from adaptive_sparse_attention.kernels.triton.build_ahead import build_ahead, record_builds, triton_knobs
segments = [(0, 256, "text"), (256, 256 + 8 * 24 * 42, "video", (8, 24, 42))]
config, device = SparseConfig(kernel="triton", precision="bf16"), torch.device("cuda")
q, k, v = (torch.randn(1, 2, 256 + 8 * 24 * 42, 128, device=device, dtype=torch.bfloat16) for _ in range(3))
call = lambda: sparse_attention(q, k, v, SequenceLayout.from_segments(segments), config)
ahead = build_ahead(call, device, 4)
knobs, real = triton_knobs(), []
knobs.runtime.jit_cache_hook = lambda *, key, fn, **_: real.append(fn.name) or False
out = call()
torch.cuda.synchronize()
knobs.runtime.jit_cache_hook = None
again, ended = record_builds(call, knobs)
print(json.dumps({"ahead": ahead, "real": real, "again": len(again), "ended": ended,
                  "finite": bool(out.isfinite().all())}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_call_after_building_ahead_builds_nothing(tmp_path):
    """A fresh process with an empty Triton cache: the dry run records the call's kernels, the threads build
    them under the JIT's own keys (the call then builds none), and a second dry run, every kernel built now,
    stops at its first launch instead of running it."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    done = subprocess.run([sys.executable, "-c", REAL_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["ahead"] is None:
        pytest.skip("this Triton has no build hooks (they came in 3.4)")
    assert result["ahead"] >= 10 and result["real"] == [] and result["finite"]
    assert result["again"] == 0 and result["ended"].startswith("Launched"), result
