"""The node measures every sparse call's error on sampled exact rows and shows it: summed on the device per
step and block (`nodes/error_meter.py`), read once for the run's report and console summary."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from adaptive_sparse_attention.nodes.error_target import FLOOR, Course
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


def test_where_every_video_row_is_sampled_the_meter_reads_the_true_error():
    """Two video blocks of 64 rows, two strata: every video row is sampled, so the meter's error over two steps
    (their rotations differ) is the relative L2 of the output's video rows against dense SDPA, computed here."""
    from adaptive_sparse_attention import SequenceLayout, sparse_attention
    from adaptive_sparse_attention.nodes.error_meter import ErrorMeter

    layout = SequenceLayout.from_segments([(0, 64, "text"), (64, 192, "video", (2, 8, 8))])
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 192, 64, dtype=torch.float64) for _ in range(3))
    cfg = config(topk_ratio=0.5, tail="mean")  # one of the two video key blocks exact, the other a mean
    meter = ErrorMeter()
    for step in (5, 6):
        out = sparse_attention(q, k, v, layout, cfg, error_rotation=step, error_sink=meter.sink(step, 0, 0, 2, 0.5))
    video = slice(64, 192)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    true = float((out - dense)[..., video, :].norm() / dense[..., video, :].norm())
    diff, exact = ((x[..., video, :] ** 2).sum((0, 2, 3)) for x in (out - dense, dense))
    heads = (diff / exact).sqrt().tolist()
    error = meter.summary()
    assert true > 0.01  # a real error, not rounding
    assert error["mean"] == pytest.approx(true, rel=1e-9)
    assert error["steps"] == {5: pytest.approx(true, rel=1e-9), 6: pytest.approx(true, rel=1e-9)}
    assert error["worst_block"] == (0, pytest.approx(true, rel=1e-9))
    worst = max(range(2), key=heads.__getitem__)
    assert error["worst_head"] == (0, worst, pytest.approx(heads[worst], rel=1e-9))
    assert meter.last_step(before=7, after=-1) == (6, {0: (0.5, pytest.approx(true, rel=1e-9))})


def test_the_report_and_summary_show_the_measured_error():
    report, summary = run(0.25)
    error = report["error"]
    assert set(error["steps"]) == {5, 6}
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


def first_moves(hook, step: int, target: float) -> list[float]:
    """The ratios of blocks 0 and 1 that the rule's first step gives from the run's measured (ratio, error) of
    `step`, each block's own."""
    _, measured = hook.tracker.stats.errors.last_step(before=step + 1, after=step - 1)
    moves = []
    for block in (0, 1):
        course = Course(0.2)
        course.learn(*measured[block], target)
        moves.append(course.ratio)
    return moves


def test_an_error_target_moves_each_blocks_ratio_from_the_step_before(monkeypatch):
    """The first sparse step runs at topk_ratio; a target far below the measured error raises the ratios, one far
    above lowers them to the floor; a skipped step (EasyCache) learns from the latest measured one."""
    low, _ = ratios_of_a_run(monkeypatch, (5, 6, 7), topk_ratio=0.2, error_target=0.001)
    assert low[:2] == [0.2, 0.2] and low[2:4] == [pytest.approx(0.4)] * 2 and low[4:] == [pytest.approx(0.5)] * 2
    high, hook = ratios_of_a_run(monkeypatch, (5, 8), topk_ratio=0.2, error_target=0.9)
    expected = first_moves(hook, 5, 0.9)
    assert high == [0.2, 0.2, *expected] and all(FLOOR <= r < 0.2 for r in expected)
    fixed, _ = ratios_of_a_run(monkeypatch, (5, 6, 7), topk_ratio=0.2)
    assert fixed == [0.2] * 6  # off: topk_ratio decides


def test_an_error_target_with_plan_reuse_rebuilds_plans_whose_ratio_moved(monkeypatch):
    seen, hook = ratios_of_a_run(monkeypatch, (5, 6, 7), topk_ratio=0.2, error_target=0.001, plan_reuse="on")
    assert seen[2:4] == [pytest.approx(0.4)] * 2
    plans = hook.tracker.plans.summary()
    assert plans["reused"] == 0 and plans["built"] == 6  # each step's new ratio plans afresh


def test_under_ramp_the_ramped_steps_teach_the_target_nothing(monkeypatch):
    """ramp over 4 of 10 steps: steps 1-3 at 0.8, 0.6 and 0.4 (measured there), step 4 the first at topk_ratio: it
    runs at topk_ratio (no ramp step's error is applied to it), and step 5 moves from step 4's own error."""
    seen, hook = ratios_of_a_run(monkeypatch, (1, 2, 3, 4, 5), topk_ratio=0.2, error_target=0.9, warmup_mode="ramp",
                                 warmup_ratio=0.4)
    assert seen[:8] == [pytest.approx(0.8)] * 2 + [pytest.approx(0.6)] * 2 + [pytest.approx(0.4)] * 2 + [0.2] * 2
    assert hook.tracker.stats.errors.ratios[(3, 0)] == pytest.approx(0.4)  # each measurement keeps its ratio
    expected = first_moves(hook, 4, 0.9)
    assert seen[8:] == expected and all(FLOOR <= r < 0.2 for r in expected)


def test_an_error_target_needs_the_measurement_and_a_start_within_its_range():
    from adaptive_sparse_attention import SparseAttentionError, SparseConfig

    with pytest.raises(SparseAttentionError, match="error_target=0.1 is not allowed with measure_error=False"):
        SparseConfig(error_target=0.1, measure_error=False)
    for ratio in (0.8, 0.02):  # the cap and the floor would override it silently
        with pytest.raises(SparseAttentionError, match=rf"topk_ratio={ratio} is not allowed with error_target=0.1: "
                           r".* allowed: topk_ratio in \[0.05, 0.5\], or error_target=0"):
            SparseConfig(topk_ratio=ratio, error_target=0.1)
    assert SparseConfig(topk_ratio=0.8).error_target == 0.0  # without a target any ratio
    assert SparseConfig(topk_ratio=0.5, error_target=0.1).topk_ratio == 0.5


@pytest.fixture
def node_classes(monkeypatch):
    """The sparse and Raylight nodes, imported over a stand-in of ComfyUI's V3 API (`comfy_api.latest.io`: the nodes
    only name its classes at import), so their `validate_inputs` runs without ComfyUI."""
    class Part:
        def __init__(self, *args, advanced=False, **kwargs):
            pass

    part = types.SimpleNamespace(Input=Part, Output=Part)
    io = types.SimpleNamespace(ComfyNode=object, Schema=dict, NodeOutput=tuple, Custom=lambda name: part,
                               **{kind: part for kind in ("Float", "Int", "Combo", "String", "Boolean", "Model")})
    latest = types.ModuleType("comfy_api.latest")
    latest.io = io
    api = types.ModuleType("comfy_api")
    api.latest = latest
    ours = [f"adaptive_sparse_attention.nodes.{name}" for name in ("schema", "sparse_node", "raylight_node")]
    saved = {name: sys.modules.pop(name) for name in ours if name in sys.modules}
    monkeypatch.setitem(sys.modules, "comfy_api", api)
    monkeypatch.setitem(sys.modules, "comfy_api.latest", latest)
    from adaptive_sparse_attention.nodes.raylight_node import AdaptiveSparseAttentionH3Raylight
    from adaptive_sparse_attention.nodes.sparse_node import AdaptiveSparseAttentionH3
    yield AdaptiveSparseAttentionH3, AdaptiveSparseAttentionH3Raylight
    for name in ours:
        sys.modules.pop(name, None)
    sys.modules.update(saved)


def test_a_prompt_with_an_error_target_it_cannot_hold_is_refused_when_queued(node_classes):
    """ComfyUI calls `validate_inputs` with the prompt's widget values before anything runs; a linked (None) or
    left-out value is checked when the node runs."""
    for node in node_classes:
        refused = node.validate_inputs(topk_ratio=0.2, measure_error=False, error_target=0.1)
        assert refused == ("SparseConfig.error_target=0.1 is not allowed with measure_error=False: the target is held "
                           "from the measured error; allowed: measure_error=True, or error_target=0")
        capped = node.validate_inputs(topk_ratio=0.8, measure_error=True, error_target=0.1)
        assert capped.startswith("SparseConfig.topk_ratio=0.8 is not allowed with error_target=0.1")
        assert node.validate_inputs(topk_ratio=0.8, measure_error=False, error_target=0.0) is True
        assert node.validate_inputs(topk_ratio=0.2, measure_error=True, error_target=0.1) is True
        assert node.validate_inputs(measure_error=None, error_target=0.1) is True  # linked: checked when it runs
        assert "block_size=100 is not allowed" in node.validate_inputs(block_size=100)
