"""The kernels of a run compile in a child process while the dense warmup steps run (`nodes/warm_start.py`):
a sparse step that comes first prepares itself beside a child still running, then stops it (each loads
what the other built first),
a failing or stuck child is said once and this process compiles itself, children are bounded and always reaped. The children here are real
processes running stand-in compile jobs, and once the real ``install.py prepare --shape`` command."""
from __future__ import annotations

import gc
import importlib.util
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from adaptive_sparse_attention import SequenceLayout, SparseConfig
from adaptive_sparse_attention.backend.warmup import preparation_key
from adaptive_sparse_attention.nodes.warm_start import (STANDBY_KEY, STANDBY_LINE, UP_LINE, WarmStart, job_key,
                                                        prepare_command, shape_spec, standby_for, start_during_warmup,
                                                        take_over_before_sparse)

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = [(0, 64, "text"), (64, 64 + 4 * 8 * 8, "video", (4, 8, 8))]


def stand_in(code: str):
    """A WarmStart command running `code` in a real child process instead of compiling."""
    return lambda spec: [sys.executable, "-c", code]


def sleeping(seconds: float, line: str = "compiling") -> str:
    return f"import time; print({line!r}, flush=True); time.sleep({seconds})"


def standby_child(seconds: float) -> str:
    """A standby stand-in: says it is up, reads its run shape, echoes it after UP_LINE, compiles for `seconds`."""
    return (f"import sys, time; print({STANDBY_LINE!r}, flush=True); spec = sys.stdin.readline().strip(); "
            f"spec or sys.exit(0); print({UP_LINE!r}, spec, flush=True); time.sleep({seconds})")


def up_to(job, line: str) -> None:
    """Block until the child wrote `line` (its imports are done)."""
    while line not in job.text():
        assert job.poll() is None, job.text()
        time.sleep(0.05)


def ended(warm: WarmStart, key: tuple) -> None:
    """Block until the child of `key` ended (as the dense warmup steps would, if they lasted long enough)."""
    while warm.jobs[key].poll() is None:
        time.sleep(0.05)


def test_a_sparse_step_before_the_childs_start_up_prepares_beside_it_then_stops_it(caplog):
    """A child still starting up keeps going while this process prepares (either loads what the other built
    first), and is stopped when this process is done."""
    warm = WarmStart(stand_in(sleeping(30.0)))
    assert warm.start(("shape",), "{}")
    time.sleep(0.5)  # the one dense warmup step of a few-step run
    beside = []
    started = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        prepare = lambda: beside.append(warm.jobs[("shape",)].process.poll() is None)  # noqa: E731
        assert warm.take_over(("shape",), prepare) is False  # stopped after this process prepared
        assert warm.take_over(("shape",), prepare) is False
    assert time.perf_counter() - started < 5  # no wait for the child
    assert beside == [True]  # prepared once, with the child still running
    job = warm.jobs[("shape",)]
    assert job.process.returncode is not None  # reaped: no zombie
    stopped = [r for r in caplog.records if "was stopped" in r.getMessage()]
    assert [r.levelno for r in stopped] == [logging.INFO]
    assert "this process prepared beside it in" in stopped[0].getMessage()
    assert warm.start(("shape",), "{}") is False  # ended: no second child for the shape


def test_a_sparse_step_prepares_beside_a_child_that_is_compiling_and_says_how_long(caplog):
    """Past its start-up (it wrote UP_LINE) the child still runs when the first sparse step comes: this process
    prepares beside it (whichever builds a kernel first, the other loads it) instead of waiting for its end,
    then stops it; the log says where the child was and how long this process took."""
    warm = WarmStart(stand_in(sleeping(30.0, line=f"{UP_LINE} for 320 tokens on cuda")))
    assert warm.start(("shape",), "{}")
    up_to(warm.jobs[("shape",)], UP_LINE)
    started = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        assert warm.take_over(("shape",), prepare=lambda: time.sleep(0.6)) is False
    assert 0.5 < time.perf_counter() - started < 5
    job = warm.jobs[("shape",)]
    assert job.process.returncode is not None
    said = [r.getMessage() for r in caplog.records if "was stopped" in r.getMessage()]
    assert len(said) == 1 and ", compiling; this process prepared beside it in 0." in said[0], said


def test_warmup_steps_leave_the_preparation_to_a_running_child():
    warm = WarmStart(stand_in(sleeping(1.0)))
    assert warm.start(("shape",), "{}")  # started: this warmup step does not prepare
    assert warm.start(("shape",), "{}")  # still running: nor does the next
    warm.jobs[("shape",)].process.wait()
    assert warm.start(("shape",), "{}") is False  # ended: the next warmup step prepares (loads from the cache)
    assert len(warm.jobs) == 1


def test_a_child_done_before_the_first_sparse_step_costs_no_wait(caplog):
    warm = WarmStart(stand_in("print('ready')"))
    assert warm.start(("shape",), "{}")
    ended(warm, ("shape",))  # the dense warmup steps outlasted the child
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        assert warm.take_over(("shape",)) is True
    assert any("the child process compiled the kernels" in r.getMessage() for r in caplog.records)


def test_a_new_clip_length_prepares_here_once_a_child_of_another_length_ended():
    """After a child of one clip length ended, a new length of the same kernels starts no child (the warmup
    step prepares here: at most a few row-bucket kernels build); other kernels (another dtype) still get one,
    and so does a new length while the first child still runs."""
    config, device = SparseConfig(kernel="triton"), torch.device("cuda")
    first, second = (SequenceLayout.from_segments([(0, 64, "text"), (64, 64 + f * 64, "video", (f, 8, 8))])
                     for f in (4, 5))
    warm = WarmStart(stand_in(sleeping(2.0)))
    args = (config, torch.bfloat16, device, 64, 2)
    assert start_during_warmup(warm, first, *args)
    assert start_during_warmup(warm, second, *args)  # the first child still runs: a child of its own
    ended(warm, job_key(first, *args))
    ended(warm, job_key(second, *args))
    third = SequenceLayout.from_segments([(0, 64, "text"), (64, 64 + 6 * 64, "video", (6, 8, 8))])
    assert not start_during_warmup(warm, third, *args)  # prepares here
    assert job_key(third, *args) not in warm.jobs
    assert start_during_warmup(warm, third, config, torch.float16, device, 64, 2)  # other kernels: a child


def test_a_failing_child_is_said_once_and_this_process_compiles(caplog):
    warm = WarmStart(stand_in("print('CUDA error: no kernel image is available'); raise SystemExit(3)"))
    assert warm.start(("shape",), "{}")
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        ended(warm, ("shape",))
        assert warm.take_over(("shape",)) is False
        assert warm.take_over(("shape",)) is False
        assert warm.start(("shape",), "{}") is False  # a later warmup step compiles here, no second child
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert failed == ["adaptive sparse attention: the child process compiling the kernels failed (exit code 3: "
                      "CUDA error: no kernel image is available); they compile in this process instead"]
    assert len(warm.jobs) == 1


def test_a_child_that_does_not_start_is_said_and_this_process_compiles(caplog, tmp_path):
    warm = WarmStart(lambda spec: [str(tmp_path / "no-such-python")])
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        assert warm.start(("shape",), "{}") is False
    assert warm.jobs == {}
    assert any("did not start" in r.getMessage() for r in caplog.records)


def test_a_child_past_its_budget_is_stopped_and_reaped():
    warm = WarmStart(stand_in(sleeping(60)), budget_s=0.5)
    assert warm.start(("shape",), "{}")
    started = time.perf_counter()
    ended(warm, ("shape",))
    assert time.perf_counter() - started < 10
    assert warm.take_over(("shape",)) is False
    job = warm.jobs[("shape",)]
    assert job.process.returncode is not None  # reaped: no zombie
    assert job.problem == "still running after 0 s, stopped"


def test_children_are_bounded_per_owner():
    warm = WarmStart(stand_in(sleeping(60)), limit=2)
    try:
        assert warm.start(("a",), "{}") and warm.start(("b",), "{}")
        assert warm.start(("c",), "{}") is False  # two still run: this process compiles c itself
        warm.jobs[("a",)].stop()
        assert warm.start(("c",), "{}")  # the ended one makes room
        assert sorted(warm.jobs) == [("b",), ("c",)]
    finally:
        warm.close()


def test_children_are_killed_and_reaped_when_their_owner_goes():
    warm = WarmStart(stand_in(sleeping(60)))
    assert warm.start(("shape",), "{}")
    process, output = warm.jobs[("shape",)].process, Path(warm.jobs[("shape",)].output.name)
    assert output.is_file()
    del warm
    gc.collect()
    assert process.returncode is not None
    assert not output.exists()  # the child's output file goes with it


def test_the_real_child_command_prepares_a_shape():
    """``install.py prepare --shape`` in a child process, on the torch kernel (nothing compiles on the CPU)."""
    layout = SequenceLayout.from_segments(LAYOUT)
    config = SparseConfig(kernel="torch")
    spec = shape_spec(layout, config, torch.bfloat16, torch.device("cpu"), 64)
    warm = WarmStart()
    assert warm.command is prepare_command
    key = job_key(layout, config, torch.bfloat16, torch.device("cpu"), 64, 2)
    assert warm.start(key, spec)
    ended(warm, key)
    assert warm.take_over(key) is True, warm.jobs[key].last_line()
    assert warm.jobs[key].last_line() == "prepare --shape: nothing compiles for this shape"


def test_a_standby_child_takes_the_run_shape_at_the_first_warmup_step():
    """Started when the node patches the model, the child is past its start-up when the first warmup step
    comes: that step hands it the run shape instead of starting a child, and its budget runs from then."""
    warm = WarmStart(stand_in(standby_child(0.5)), budget_s=30)
    assert warm.standby() and not warm.standby()  # one standby child per owner
    spare = warm.jobs[STANDBY_KEY]
    up_to(spare, STANDBY_LINE)
    time.sleep(0.3)
    assert spare.poll() is None  # it waits for its run shape, past no budget
    assert warm.start(("shape",), '{"run": 1}')
    job = warm.jobs[("shape",)]
    assert job is spare and STANDBY_KEY not in warm.jobs and job.budget_s == 30
    ended(warm, ("shape",))
    assert warm.take_over(("shape",)) is True
    assert f'{UP_LINE} {{"run": 1}}' in job.text()  # it prepared the shape written to it
    assert warm.standby() is False  # a child ran for this owner: no second standby


def test_a_run_shape_prepared_from_memory_starts_no_child_and_stops_the_standby():
    """Where this process holds every kernel of the run shape (`from_memory` runs through), the first warmup
    step prepares here: no child starts and the standby child is stopped before it touches the GPU. Where a
    kernel is not in memory (`from_memory` gives None) the standby child takes the shape as before; a shape
    prepared already, or one whose child runs, does not try again."""
    config, device = SparseConfig(kernel="triton"), torch.device("cuda")
    layout = SequenceLayout.from_segments(LAYOUT)
    args = (config, torch.bfloat16, device, 64, 2)
    tries = []

    def held() -> float:
        tries.append("held")
        layout.cache.get("prepared", preparation_key(*args), lambda: 0.1)  # what prepare_from_memory records
        return 0.1

    warm = WarmStart(stand_in(standby_child(5.0)))
    assert warm.standby()
    spare = warm.jobs[STANDBY_KEY].process
    assert not start_during_warmup(warm, layout, *args, from_memory=held)
    assert tries == ["held"] and warm.jobs == {} and spare.poll() is not None  # stopped and reaped
    assert not start_during_warmup(warm, layout, *args, from_memory=held)  # prepared: nothing tried again
    assert tries == ["held"]

    other = SequenceLayout.from_segments(LAYOUT)
    warm = WarmStart(stand_in(standby_child(5.0)))
    assert warm.standby()
    missing = []
    assert start_during_warmup(warm, other, *args, from_memory=lambda: missing.append(1))  # None: a kernel missing
    assert missing == [1] and job_key(other, *args) in warm.jobs and STANDBY_KEY not in warm.jobs
    assert start_during_warmup(warm, other, *args, from_memory=lambda: missing.append(2))  # its child runs
    assert missing == [1]
    warm.close()


def test_a_standby_child_no_shape_came_to_is_stopped_at_the_first_sparse_step():
    warm = WarmStart(stand_in(standby_child(0)))
    assert warm.standby()
    spare = warm.jobs[STANDBY_KEY]
    output = Path(spare.output.name)
    layout = SequenceLayout.from_segments(LAYOUT)
    assert take_over_before_sparse(warm, layout, SparseConfig(), torch.bfloat16, torch.device("cpu"), 64, 2) is None
    assert spare.process.returncode is not None and not warm.jobs and not output.exists()


def test_without_warmup_steps_the_standby_child_takes_the_first_sparse_steps_shape(monkeypatch, caplog):
    """``warmup_mode`` speed: no warmup step hands the standby child a shape, so the first sparse step does,
    and prepares beside it (the child builds side by side), then stops it. The preparation here is a stand-in:
    this machine has no CUDA device to compile for."""
    from adaptive_sparse_attention.nodes import warm_start

    layout, config, device = SequenceLayout.from_segments(LAYOUT), SparseConfig(kernel="triton"), torch.device("cuda")
    warm = WarmStart(stand_in(standby_child(30.0)))
    assert warm.standby()
    spare = warm.jobs[STANDBY_KEY]
    up_to(spare, STANDBY_LINE)
    beside = []
    monkeypatch.setattr(warm_start, "prepare_kernels",
                        lambda *args, **kwargs: (up_to(spare, UP_LINE), beside.append(spare.poll() is None)))
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        assert take_over_before_sparse(warm, layout, config, torch.bfloat16, device, 64, 2) is False
    key = job_key(layout, config, torch.bfloat16, device, 64, 2)
    assert list(warm.jobs) == [key] and warm.jobs[key] is spare
    assert f"{UP_LINE} {shape_spec(layout, config, torch.bfloat16, device, 64)}" in spare.text()
    assert beside == [True] and spare.process.returncode is not None  # prepared beside it, then it was stopped
    assert any("this process prepared beside it" in r.getMessage() for r in caplog.records)


def test_a_standby_child_that_ended_is_replaced_by_a_new_child(caplog):
    warm = WarmStart(stand_in(f"print({STANDBY_LINE!r}); import sys; sys.exit(5)"))
    assert warm.standby()
    old = warm.jobs[STANDBY_KEY].process
    old.wait()
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        warm.start(("shape",), "{}")  # a new child: this stand-in exits at once, with code 5
    assert warm.jobs[("shape",)].process.pid != old.pid and STANDBY_KEY not in warm.jobs
    assert any("the standby child process ended before the run shape came (exit code 5" in r.getMessage()
               for r in caplog.records)


def test_a_standby_child_only_where_kernels_compile():
    """No standby child on the CPU, on the torch reference kernel, or without Triton."""
    warm = WarmStart(stand_in(standby_child(0)))
    assert standby_for(warm, torch.device("cpu"), SparseConfig()) is False
    assert standby_for(warm, torch.device("cuda"), SparseConfig(kernel="torch")) is False
    assert not warm.jobs


def test_no_standby_child_where_the_process_holds_the_kernels(monkeypatch, caplog):
    """A model patched again in a process that ran sparse steps on the device prepares from memory: no standby
    child starts (one starting beside that preparation slowed it, H200 2026-12-05); where it holds nothing, one
    does."""
    from types import SimpleNamespace

    from adaptive_sparse_attention.nodes import warm_start

    warm = WarmStart(stand_in(standby_child(30)))
    found = SimpleNamespace(util=SimpleNamespace(find_spec=lambda name: object()))  # Triton "importable" here
    monkeypatch.setattr(warm_start, "importlib", found)
    monkeypatch.setattr(warm_start, "holds_kernels", lambda device: True)
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        assert standby_for(warm, torch.device("cuda"), SparseConfig()) is False
    assert not warm.jobs and any("no standby child" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(warm_start, "holds_kernels", lambda device: False)
    assert standby_for(warm, torch.device("cuda"), SparseConfig()) is True and STANDBY_KEY in warm.jobs
    warm.close()


def test_holds_compiled_reads_the_device_cache_without_adding_to_it():
    """`holds_compiled` looks at a JIT function's per-device cache (Triton's `device_caches`, a defaultdict that
    would build an entry, and initialise the driver, on a plain lookup) and is False for anything else."""
    from collections import defaultdict
    from types import SimpleNamespace

    from adaptive_sparse_attention.kernels.triton.build_ahead import holds_compiled

    def binder():
        raise AssertionError("a lookup created an entry")

    caches = defaultdict(binder)
    caches[0] = ({"key": "kernel"}, {}, None, None, None)
    caches[1] = ({}, {}, None, None, None)
    fn = SimpleNamespace(device_caches=caches)
    assert holds_compiled(fn, 0) is True
    assert holds_compiled(fn, 1) is False
    assert holds_compiled(fn, 2) is False and 2 not in caches
    assert holds_compiled(SimpleNamespace(), 0) is False
    assert holds_compiled(SimpleNamespace(device_caches={0: "other layout"}), 0) is False
    from adaptive_sparse_attention.backend.warmup import holds_kernels
    assert holds_kernels(torch.device("cpu")) is False


def test_the_real_standby_command_reads_its_shape_from_its_input():
    """``install.py prepare --shape -``: imports, says it waits, then prepares the shape written to it."""
    layout = SequenceLayout.from_segments(LAYOUT)
    config = SparseConfig(kernel="torch")
    warm = WarmStart()
    assert warm.standby()
    up_to(warm.jobs[STANDBY_KEY], STANDBY_LINE)
    key = job_key(layout, config, torch.bfloat16, torch.device("cpu"), 64, 2)
    assert warm.start(key, shape_spec(layout, config, torch.bfloat16, torch.device("cpu"), 64))
    ended(warm, key)
    assert warm.take_over(key) is True, warm.jobs[key].text()
    assert warm.jobs[key].last_line() == "prepare --shape: nothing compiles for this shape"
    idle = WarmStart()  # one no shape comes to ends by itself when its input closes
    assert idle.standby()
    process = idle.jobs[STANDBY_KEY].process
    up_to(idle.jobs[STANDBY_KEY], STANDBY_LINE)
    process.stdin.close()
    assert process.wait(timeout=60) == 0


def test_a_standby_child_no_shape_comes_to_exits_by_itself():
    """Its input kept open but no shape written: past STANDBY_WAIT_S it exits (0), no parent need stop it."""
    code = ("import argparse; from adaptive_sparse_attention.bench import prepare; prepare.STANDBY_WAIT_S = 0.5; "
            "p = argparse.ArgumentParser(); prepare.add_arguments(p); prepare.run(p.parse_args(['--shape', '-']))")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.wait(timeout=120) == 0  # its input still open: the timer ended it (a few lines of output)
    finally:
        child.kill()
        child.stdin.close()
    assert STANDBY_LINE in child.stdout.read()
    child.stdout.close()


def test_the_shape_spec_rebuilds_the_layout_and_config():
    from adaptive_sparse_attention.bench.prepare import prepare_shape

    layout = SequenceLayout.from_segments(LAYOUT)
    spec = shape_spec(layout, SparseConfig(kernel="torch", topk_ratio=0.3), torch.float16, torch.device("cpu"), 64)
    assert json.loads(spec)["heads"] == 1  # the child prepares one head: it shares the GPU with the model
    lines = []
    assert prepare_shape(spec, lines.append) is None
    assert lines[0] == "prepare --shape: compiling the kernels for 320 tokens on cpu"
    with pytest.raises(ValueError, match="dtype='int8' is not allowed: bfloat16, float16"):
        prepare_shape(spec.replace('"float16"', '"int8"'))
    with pytest.raises(ValueError, match="exactly the keys segments, config, dtype, head_dim, heads, device"):
        prepare_shape('{"segments": []}')


def test_no_child_where_nothing_compiles_or_without_a_gpu():
    """On the CPU (interpreter or torch kernel) the node prepares in this process as before."""
    layout = SequenceLayout.from_segments(LAYOUT)
    warm = WarmStart(stand_in("raise SystemExit(1)"))
    assert not start_during_warmup(warm, layout, SparseConfig(kernel="torch"), torch.bfloat16, torch.device("cpu"), 64,
                               2)
    assert warm.jobs == {}
    assert take_over_before_sparse(warm, layout, SparseConfig(kernel="torch"), torch.bfloat16, torch.device("cpu"),
                                   64, 2) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_child_fills_tritons_cache_for_the_run_shape(tmp_path, monkeypatch):
    """On a GPU, with an empty Triton cache: the real child compiles the run shape's kernels into it."""
    pytest.importorskip("triton")
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))  # the child inherits this process's environment
    layout = SequenceLayout.from_segments([(0, 256, "text"), (256, 256 + 8 * 24 * 42, "video", (8, 24, 42))])
    config, device = SparseConfig(kernel="triton", precision="bf16"), torch.device("cuda")
    warm = WarmStart()
    assert start_during_warmup(warm, layout, config, torch.bfloat16, device, 128, 4)
    assert start_during_warmup(warm, layout, config, torch.bfloat16, device, 128, 4)  # one child for the shape
    assert len(warm.jobs) == 1
    job = next(iter(warm.jobs.values()))
    job.process.wait()
    assert take_over_before_sparse(warm, layout, config, torch.bfloat16, device, 128, 4) is True, job.last_line()
    assert job.last_line().startswith("prepare --shape: ready in")
    assert any(cache.rglob("*.cubin"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_shape_whose_kernels_this_process_holds_prepares_from_memory(monkeypatch):
    """After one preparation, the same run shape on another layout object (a model patched again) prepares
    from memory; a kernel this process does not hold stops that preparation at its launch, nothing recorded."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from adaptive_sparse_attention.backend import warmup
    from adaptive_sparse_attention.kernels.triton.build_ahead import triton_knobs

    if triton_knobs() is None:
        pytest.skip("this Triton has no jit_cache_hook (it came in 3.4)")
    segments = [(0, 256, "text"), (256, 256 + 8 * 24 * 42, "video", (8, 24, 42))]
    layout = SequenceLayout.from_segments(segments)
    args = (SparseConfig(kernel="triton", precision="bf16"), torch.bfloat16, torch.device("cuda"), 128, 4)
    assert warmup.prepare_kernels(layout, *args) is not None
    assert warmup.holds_kernels(torch.device("cuda"))  # Triton's per-device cache, as `holds_compiled` reads it
    again = SequenceLayout.from_segments(segments)
    seconds = warmup.prepare_from_memory(again, *args)
    assert seconds is not None and warmup.prepared(again, *args)
    assert warmup.prepare_from_memory(again, *args) is None  # prepared already: nothing runs

    @triton.jit
    def never_built(X):
        tl.store(X, 1.0)

    launch_all = warmup.launch_all
    monkeypatch.setattr(warmup, "launch_all", lambda *a, **k: (launch_all(*a, **k),
                                                              never_built[(1,)](torch.zeros(1, device="cuda"))))
    third, hook = SequenceLayout.from_segments(segments), triton_knobs().runtime.jit_cache_hook
    assert warmup.prepare_from_memory(third, *args) is None
    assert not warmup.prepared(third, *args)
    assert triton_knobs().runtime.jit_cache_hook is hook  # put back


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_preparation_at_the_calls_head_count_leaves_the_first_sparse_call_nothing_to_build():
    """`prepare_kernels` with the call's head count builds every Triton specialisation the call launches,
    the reblock split's chunk of wide levels included (picked by its program count, heads x nodes: with one
    head the first sparse step of a 10 s clip built it)."""
    pytest.importorskip("triton")
    from adaptive_sparse_attention import sparse_attention
    from adaptive_sparse_attention.backend.warmup import prepare_kernels

    spec = importlib.util.spec_from_file_location("first_call_timing", ROOT / "tools" / "first_call_timing.py")
    timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timing)
    # video levels of 40,320, 20,160 and 10,080 tokens are wide (over 8,192); 32 heads x 4 nodes reach 128 programs
    layout = SequenceLayout.from_segments([(0, 256, "text"), (256, 256 + 40 * 24 * 42, "video", (40, 24, 42))])
    config, device, heads = SparseConfig(kernel="triton", precision="bf16"), torch.device("cuda"), 32
    assert prepare_kernels(layout, config, torch.bfloat16, device, 128, heads) is not None
    q, k, v = (torch.randn(1, heads, layout.total, 128, device=device, dtype=torch.bfloat16) for _ in range(3))
    with timing.built_kernels() as built:
        if built is None:
            pytest.skip("this Triton has no compile hooks (they came in 3.4)")
        sparse_attention(q, k, v, layout, config)
        torch.cuda.synchronize()
    assert built == []
