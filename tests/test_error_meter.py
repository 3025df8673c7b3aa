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
