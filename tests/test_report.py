"""The run report: RunTracker.report() data and the text the report node shows (no ComfyUI)."""
from __future__ import annotations

import pytest

import torch

from adaptive_sparse_attention.nodes.error_meter import SCALE
from adaptive_sparse_attention.nodes.run_tracker import RunTracker
from adaptive_sparse_attention.nodes.report import format_report, spans


def test_spans():
    assert spans([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert spans([3]) == "3"
    assert spans([]) == "none"


def test_report_of_a_run_and_its_text():
    tracker = RunTracker("t")
    for step in range(4):
        for layer in range(3):
            if step == 0:
                tracker.note_block(step, sparse=False, layer=layer, reason="warmup (step 1 of 4)")
            elif layer == 2:
                tracker.note_block(step, sparse=False, layer=layer, reason="layer 2 is in dense_layers")
            else:
                tracker.note_block(step, sparse=True, density=0.25, layer=layer)
    tracker.stats.attention_ms = 1500.0
    tracker.note_timing(("shape",), sparse_ms=100.0, dense_ms=400.0)  # dense took 4x as long
    tracker.precision = ("8-bit", "auto: ComfyUI runs attention_sage")
    for _ in range(3):
        tracker.note_dense_kernel("SDPA cuDNN")
    measured = "sparse attention for bfloat16 B1 H56 D128 ... runs on cuDNN-frontend (measured, ...)"
    for _ in range(2):
        tracker.note_sparse_kernel("cuDNN-frontend", measured)
    tracker.note_sparse_kernel("Triton bf16", "")  # after cuDNN-frontend raised, say
    for step in (1, 2, 3):  # sampled error sums of blocks 0 and 1, two heads in groups of one
        for layer in (0, 1):
            for h0 in (0, 1):
                diff = torch.tensor([(1.0 + layer) * (1.0 + 3 * h0) * step])
                tracker.stats.errors.sink(step, layer, h0, 2)(diff, torch.tensor([100.0 * step]))
    assert tracker.last_report is None
    tracker.finish()
    report = tracker.last_report
    assert report == {"steps_sparse": [1, 2, 3], "steps_dense": [0], "blocks_sparse": 6, "blocks_dense": 6,
                      "layers_sparse": [0, 1], "layers_dense_only": [2], "mean_density": 0.25, "attention_s": 1.5,
                      "est_saved_s": pytest.approx(4.5), "dense_reasons": {"warmup (step 1 of 4)": 3,
                                                                           "layer 2 is in dense_layers": 3},
                      "precision": "8-bit", "precision_reason": "auto: ComfyUI runs attention_sage",
                      "dense_kernels": {"SDPA cuDNN": 3}, "sparse_kernels": {"cuDNN-frontend": 2, "Triton bf16": 1},
                      "sparse_choices": [measured], "notes": [], "plans": {"reused": 0, "built": 0, "rebuilds": 0},
                      # per step: 15 s / 400 s over both blocks and heads; block 1: 10 s / 200 s; its head 1: 8 s / 100 s
                      "error": {"mean": pytest.approx(0.0375 ** 0.5), "steps": {s: pytest.approx(0.0375 ** 0.5)
                                                                                for s in (1, 2, 3)},
                                "worst_block": (1, pytest.approx(0.05 ** 0.5)),
                                "worst_head": (1, 1, pytest.approx(0.08 ** 0.5))}}
    assert "Plans reused" not in format_report(report)  # plan_reuse off: no line
    reused = dict(report, plans={"reused": 40, "built": 10, "rebuilds": 6, "built: first": 4,
                                 "built: statistics moved": 6})
    assert ("Plans reused across steps: 40; built 10, of which 6 rebuilds (first 4, statistics moved 6)"
            in format_report(reused))
    tracker.finish()  # the next run's start (nothing ran yet) keeps the last report
    assert tracker.last_report is report
    assert tracker.stats.sparse_blocks == 0
    assert not tracker.timed
    text = format_report(report)
    assert text.splitlines() == [
        "Sparse steps (0-based): 1-3; dense-only steps: 0",
        "Block calls: 6 sparse, 6 dense; layers that ran sparse: 0-1; layers always dense: 2",
        "Mean density of sparse blocks: 0.250",
        "Sparse attention time: 1.50 s; estimated time saved: 4.50 s (vs torch's dense attention, timed on one "
        "call per shape)",
        "Precision: 8-bit (auto: ComfyUI runs attention_sage)",
        "Dense attention (our override) ran on: SDPA cuDNN (3 calls)",
        "Sparse attention ran on: Triton bf16 (1 calls); cuDNN-frontend (2 calls)",
        f"Sparse kernel choice: {measured}",
        "Measured error (relative L2 of video rows against dense attention, on sampled exact rows): run mean 0.194; "
        "worst block 1 (0.224); worst head 1 of block 1 (0.283); per step: 1: 0.194, 2: 0.194, 3: 0.194",
        f"  ({SCALE})",
        "Why blocks ran dense:",
        "- layer 2 is in dense_layers: 3 block calls",
        "- warmup (step 1 of 4): 3 block calls"]


def test_report_says_when_nothing_ran_sparse():
    tracker = RunTracker("t")
    tracker.note_block(0, sparse=False, layer=0, reason="warmup_mode='dense'")
    tracker.finish()
    text = format_report(tracker.last_report)
    assert text.startswith("The sparse path did not run")
    assert "warmup_mode='dense': 1 block calls" in text
    assert "estimated time saved: not measured" in text
    assert format_report(None).startswith("No sampling run")


def test_the_second_sparse_call_of_a_shape_is_timed_against_dense():
    from h3_harness import PACKED, config, model_of, options, run_model
    from h3_block import block_args

    from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook

    model = model_of(True, seed=40, layers=1)
    args = block_args(model.blocks[0], PACKED, seed=41, new=True)
    hook = SparseAttentionHook(config())
    outs = []
    for step in (3, 4, 5):
        args["transformer_options"] = options(step)
        outs.append(run_model(model, hook, args, True))
        assert len(hook.tracker.timed) == (0 if step == 3 else 1)  # first call measures density, next is timed
    assert outs[0].equal(outs[1])
    assert outs[1].equal(outs[2])  # the timed call returns the same output
    s = hook.tracker.stats
    assert s.timed_sparse_ms > 0
    assert s.timed_dense_ms > 0
    assert hook.tracker.finish()
    assert hook.tracker.last_report["est_saved_s"] is not None
