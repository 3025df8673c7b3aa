"""The node measures every sparse call's error on sampled exact rows and shows it: summed on the device per
step and block (`nodes/error_meter.py`), read once for the run's report and console summary."""
from __future__ import annotations

import pytest
import torch

from adaptive_sparse_attention.nodes.report import format_report
from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook
from h3_block import block_args
from h3_harness import PACKED, config, model_of, options, run_model


def run(ratio: float, measure: bool = True, steps=(5, 6), chunks: int = 1):
    model = model_of(True, seed=12, layers=2)
    args = block_args(model.blocks[0], PACKED, seed=13, new=True)
    hook = SparseAttentionHook(config(topk_ratio=ratio, measure_error=measure))
    for step in steps:
        args["transformer_options"] = options(step, minimax_head_chunks=chunks)
        run_model(model, hook, args, True)
    summary = hook.tracker.finish()
    return hook.tracker.last_report, summary


def test_the_report_and_summary_show_the_measured_error():
    report, summary = run(0.25)
    error = report["error"]
    assert set(error["steps"]) == {5, 6}
    assert 1e-3 < error["mean"] < 1.0
    assert error["worst_block"][0] in (0, 1) and error["worst_block"][1] >= error["mean"] * 0.5
    layer, head, worst = error["worst_head"]
    assert layer in (0, 1) and 0 <= head < 3 and worst >= error["worst_block"][1]
    assert f"measured error {error['mean']:.3f}" in summary
    assert "Measured error (relative L2 of video rows" in format_report(report)


def test_exact_attention_measures_no_error_and_head_groups_measure_the_same():
    assert run(1.0)[0]["error"]["mean"] < 1e-10  # every key block exact (float64)
    whole, grouped = run(0.25)[0]["error"], run(0.25, chunks=2)[0]["error"]
    assert grouped["mean"] == pytest.approx(whole["mean"], rel=1e-9)
    assert grouped["worst_head"] == (whole["worst_head"][0], whole["worst_head"][1], pytest.approx(whole["worst_head"][2]))


def test_measure_error_off_measures_nothing():
    report, summary = run(0.25, measure=False)
    assert report["error"] is None and "measured error" not in summary
    assert "Measured error" not in format_report(report)


# --- the error target (`nodes/error_target.py`) ----------------------------------------------------------------

def test_the_target_moves_a_ratio_only_outside_its_band_between_floor_and_cap():
    from adaptive_sparse_attention.nodes.error_target import CAP, FLOOR, moved

    assert moved(0.2, 0.105, 0.1) == 0.2  # within 15%: stays
    assert moved(0.2, 0.15, 0.1) == pytest.approx(0.3)  # 1.5x the target: 1.5x the ratio
    assert moved(0.2, 0.06, 0.1) == pytest.approx(0.1)  # on the 0.05 grid
    assert moved(0.2, 1.0, 0.1) == pytest.approx(0.4)  # at most 2x a step
    assert moved(0.45, 1.0, 0.1) == CAP and moved(0.05, 0.0, 0.1) == FLOOR
    assert moved(0.2, float("nan"), 0.1) == 0.2


def ratios_of_a_run(monkeypatch, steps, **kw):
    """The topk_ratio of every sparse call of a run over `steps` (each step's calls of blocks 0 and 1)."""
    from adaptive_sparse_attention.nodes import sparse_call

    seen = []
    attention = sparse_call.sparse_attention
    monkeypatch.setattr(sparse_call, "sparse_attention",
                        lambda q, k, v, layout, config, **a: seen.append(config.topk_ratio) or attention(q, k, v, layout,
                                                                                                        config, **a))
    model = model_of(True, seed=12, layers=2)
    args = block_args(model.blocks[0], PACKED, seed=13, new=True)
    hook = SparseAttentionHook(config(**kw))
    for step in steps:
        args["transformer_options"] = options(step)
        run_model(model, hook, args, True)
    return seen, hook


def test_an_error_target_moves_each_blocks_ratio_from_the_step_before(monkeypatch):
    """The first sparse step runs at topk_ratio; a target far below the measured error raises the ratios, one far
    above lowers them to the floor; a skipped step (EasyCache) learns from the latest measured one."""
    low, _ = ratios_of_a_run(monkeypatch, (5, 6, 7), topk_ratio=0.2, error_target=0.001)
    assert low[:2] == [0.2, 0.2] and low[2:4] == [pytest.approx(0.4)] * 2 and low[4:] == [pytest.approx(0.5)] * 2
    high, _ = ratios_of_a_run(monkeypatch, (5, 8), topk_ratio=0.2, error_target=0.9)
    assert high == [0.2, 0.2, pytest.approx(0.1), pytest.approx(0.1)]
    fixed, _ = ratios_of_a_run(monkeypatch, (5, 6, 7), topk_ratio=0.2)
    assert fixed == [0.2] * 6  # off: topk_ratio decides


def test_an_error_target_with_plan_reuse_rebuilds_plans_whose_ratio_moved(monkeypatch):
    seen, hook = ratios_of_a_run(monkeypatch, (5, 6, 7), topk_ratio=0.2, error_target=0.001, plan_reuse="on")
    assert seen[2:4] == [pytest.approx(0.4)] * 2
    plans = hook.tracker.plans.summary()
    assert plans["reused"] == 0 and plans["built"] == 6  # each step's new ratio plans afresh


def test_an_error_target_needs_the_measurement():
    from adaptive_sparse_attention import SparseAttentionError, SparseConfig

    with pytest.raises(SparseAttentionError, match="error_target=0.1 is not allowed with measure_error=False"):
        SparseConfig(error_target=0.1, measure_error=False)
