"""In real ComfyUI (COMFYUI_PATH, CPU, tiny random H3): the measured sparse-kernel choice of ``kernel="auto"``.

Stand-in sparse kernels (`sparse_standins.py`) are declared as a family declares its rows (`SparseKernel`
rows of the table's `SPARSE_KERNELS`) and run on the CPU; the choice's timer is stubbed to time them as
the test says (CPU timings at this size are noise). Our node must then return exactly what the fastest
stand-in within the bound computes, skip a raising one and a wrong one with a warning naming them, and,
when the chosen one raises later in the run (issue 46's cuDNN-frontend UnicodeDecodeError), finish the
run on the next one (strict mode stops with the error).
"""
from __future__ import annotations

import logging

import pytest
import torch

from comfyui_harness import CKPT, comfy, needs_comfyui, sample, sparse  # noqa: F401
from sparse_standins import StandIn, Timer, row

from adaptive_sparse_attention.kernels.sparse_choice import choice as sparse_choice
from adaptive_sparse_attention.nodes.model_patches import hooks_of

pytestmark = needs_comfyui
CLOSE = 1 + 2 ** -12  # within a bf16 run's bound at float32 (1.2e-3)


def declare(monkeypatch, standins: list[StandIn], ms: dict[str, float]) -> Timer:
    """Make `standins` the table's sparse candidates, timed at `ms`."""
    monkeypatch.setattr(sparse_choice, "SPARSE_KERNELS", tuple(row(s) for s in standins))
    timer = Timer(standins, ms)
    monkeypatch.setattr(sparse_choice, "median_ms", lambda fn, device, warmup=1, reps=3: timer(fn))
    return timer


def sparse_run(nodes, model, **changes):
    """A sampler run with our node (1 dense warmup step, 3 sparse; kernel auto: the stand-ins are its candidates
    on the CPU); returns (latent, the run's report). The dense step runs ComfyUI's own attention (the dense
    choice's CPU timings would vary between runs)."""
    patched = sparse(model, **{"dense_attention": "comfyui", "kernel": "auto", **changes})
    return sample(nodes, patched), hooks_of(patched)[0].tracker.last_report


@pytest.fixture(scope="module")
def reference(comfy):
    """The run on the torch reference kernel (`kernel="torch"`): bit for bit what the "exact" stand-in returns."""
    _, nodes = comfy
    return sparse_run(nodes, nodes.UNETLoader().load_unet(CKPT, "default")[0], kernel="torch")[0]


@pytest.mark.parametrize("fast", ["exact", "scaled"])
def test_the_fastest_stand_in_runs_the_sparse_steps_and_its_bits_are_returned(comfy, reference, monkeypatch, caplog,
                                                                             fast):
    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    exact, scaled = StandIn("exact", 1.0), StandIn("scaled", CLOSE)
    declare(monkeypatch, [exact, scaled], {"exact": 1.0 if fast == "exact" else 3.0, "scaled": 2.0})
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        out, report = sparse_run(nodes, model)
    calls = report["blocks_sparse"]
    assert calls > 0 and report["sparse_kernels"] == {f"stand-in {fast}": calls}
    assert torch.equal(out, reference) is (fast == "exact")
    if fast == "scaled":
        torch.testing.assert_close(out, reference, rtol=1e-3, atol=1e-3)
    chosen = [m for m in (r.getMessage() for r in caplog.records) if m.startswith("sparse attention for")]
    assert len(chosen) == 1 and f"runs on stand-in {fast}" in chosen[0] and "stand-in scaled 2 ms (error 2.4e-04)" \
        in chosen[0], chosen
    assert report["sparse_choices"] == chosen
    assert any("sparse attention on stand-in " + fast in r.getMessage() for r in caplog.records)  # the run's summary


def test_a_raising_and_a_wrong_stand_in_are_skipped_with_a_warning_naming_them(comfy, reference, monkeypatch, caplog):
    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    standins = [StandIn("raising", 1.0, fails_from=1), StandIn("wrong", 1.1), StandIn("exact", 1.0)]
    timer = declare(monkeypatch, standins, {"raising": 1.0, "wrong": 1.0, "exact": 2.0})
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        out, report = sparse_run(nodes, model)
    assert torch.equal(out, reference)
    assert report["sparse_kernels"] == {"stand-in exact": report["blocks_sparse"]}
    assert timer.timed == ["exact"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("sparse kernel stand-in raising failed") and "UnicodeDecodeError" in m for m in warned)
    assert any(m.startswith("sparse kernel stand-in wrong differs from the float32 reference") for m in warned)


@pytest.mark.parametrize("strict", [False, True], ids=["auto", "strict"])
def test_a_chosen_kernel_that_raises_later_in_the_run_is_contained(comfy, monkeypatch, caplog, strict):
    """Issue 46: the chosen kernel raises at its 4th call (after its check, its timing and one sparse call)."""
    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    first, second = StandIn("first", 1.0, fails_from=4), StandIn("second", CLOSE)
    declare(monkeypatch, [first, second], {"first": 1.0, "second": 2.0})
    if strict:
        with pytest.raises(RuntimeError, match="sparse kernel stand-in first raised UnicodeDecodeError.*strict mode"):
            sparse_run(nodes, model)
        return
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        out, report = sparse_run(nodes, model, strict=False)
    assert torch.isfinite(out).all()
    assert report["sparse_kernels"] == {"stand-in first": 1, "stand-in second": report["blocks_sparse"] - 1}
    said = [r.getMessage() for r in caplog.records if "stand-in first raised" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("the call runs on stand-in second"), said
    assert first.calls == 4
