"""The run report: `run_report.report_of` data, its saved time, and the text the report node shows (no ComfyUI)."""
from __future__ import annotations

import pytest

import torch

from adaptive_sparse_attention.nodes.error_meter import SCALE
from adaptive_sparse_attention.nodes.run_tracker import RunTracker
from adaptive_sparse_attention.nodes.report import format_report, saving, spans
from adaptive_sparse_attention.nodes.run_report import saved_time


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
                tracker.note_block(step, sparse=True, density=0.25, layer=layer, shape=("shape",))
    tracker.stats.attention_ms = 1500.0
    # one call timed on the CPU clock: sparse 125 ms, the dense attention 500 ms (6 calls x 375 ms = 2.25 s saved)
    tracker.note_timing(("shape",), 1.0, "SDPA cuDNN", (0.0, 0.125, 0.625))
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
                      "saved": {"saved_s": 2.25, "baseline": "SDPA cuDNN", "untimed_calls": 0}, "dense_reasons": {"warmup (step 1 of 4)": 3,
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
        "Sparse attention time: 1.50 s; attention time saved: 2.25 s (sparse attention against SDPA cuDNN, the dense "
        "attention these blocks would have run, timed on one call per shape)",
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
    assert "attention time saved: not measured" in text
    assert format_report(None).startswith("No sampling run")


def test_saved_time_counts_each_shapes_calls_at_its_timed_saving():
    """Per shape: (dense - sparse) ms of its timed head groups over their share of the call's heads, times its
    sparse block calls; a shape that was never timed is counted apart, not guessed."""
    tracker = RunTracker("t")
    for shape, calls in ((("a",), 4), (("b",), 2), (("c",), 3)):
        for _ in range(calls):
            tracker.note_block(5, sparse=True, density=0.2, layer=0, shape=shape)
    # a: two head groups of half the heads each: sparse 125 + 62.5 ms, dense 250 + 250 ms -> 312.5 ms a call
    tracker.note_timing(("a",), 0.5, "SDPA cuDNN", (0.0, 0.125, 0.375))
    tracker.note_timing(("a",), 0.5, "SDPA cuDNN", (1.0, 1.0625, 1.3125))
    # b: a quarter of the heads, sparse 62.5 ms, dense 31.25 ms -> -125 ms a call (sparse was slower)
    tracker.note_timing(("b",), 0.25, "FlashAttention-4", (2.0, 2.0625, 2.09375))
    saved = saved_time(tracker.stats)
    assert saved == {"saved_s": (4 * 312.5 - 2 * 125.0) / 1e3, "baseline": "FlashAttention-4, SDPA cuDNN",
                     "untimed_calls": 3}
    assert saved["saved_s"] == 1.0
    assert "attention saved 1.00 s against FlashAttention-4, SDPA cuDNN" in tracker.summary()
    assert saving(saved) == ("attention time saved: 1.00 s (sparse attention against FlashAttention-4, SDPA cuDNN, "
                             "the dense attention these blocks would have run, timed on one call per shape); 3 sparse "
                             "block calls of shapes that ran once are not counted")
    lost = {"saved_s": -0.5, "baseline": "SDPA cuDNN", "untimed_calls": 0}
    assert saving(lost) == ("attention time lost: 0.50 s (sparse attention was SLOWER than SDPA cuDNN, the dense "
                            "attention these blocks would have run, timed on one call per shape)")
    assert saved_time(RunTracker("t").stats) is None


def test_the_second_sparse_call_of_a_shape_is_timed_against_the_dense_attention_of_a_dense_block():
    from h3_harness import PACKED, config, model_of, options, run_model
    from h3_block import block_args

    from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook

    model = model_of(True, seed=40, layers=1)
    args = block_args(model.blocks[0], PACKED, seed=41, new=True)
    hook = SparseAttentionHook(config())
    baselines = []

    def baseline(q, k, v):  # what a dense block would run, as the hook resolves it
        run, name = SparseAttentionHook.dense_baseline(hook, q, k, v)
        baselines.append((tuple(q.shape), name))
        return run, name

    hook.dense_baseline = baseline
    outs = []
    for step in (3, 4, 5):
        args["transformer_options"] = options(step)
        outs.append(run_model(model, hook, args, True))
        assert len(hook.tracker.timed) == (0 if step == 3 else 1)  # first call measures density, next is timed
    assert outs[0].equal(outs[1])
    assert outs[1].equal(outs[2])  # the timed call returns the same output
    heads, dim = model.blocks[0].attn.heads, model.blocks[0].attn.head_dim
    rows = args["img"].shape[0]
    assert baselines == [((1, heads, rows, dim), "SDPA's own choice")]  # the CPU's dense choice, no host
    (timing,) = hook.tracker.stats.timings.values()
    assert timing.share == 1.0 and timing.baseline == "SDPA's own choice"
    assert timing.sparse_ms > 0 and timing.dense_ms > 0
    assert hook.tracker.stats.shape_calls == {next(iter(hook.tracker.timed)): 3}
    assert hook.tracker.finish()
    saved = hook.tracker.last_report["saved"]
    assert saved["saved_s"] == pytest.approx(3 * (timing.dense_ms - timing.sparse_ms) / 1e3)
    assert saved["baseline"] == "SDPA's own choice" and saved["untimed_calls"] == 0


def test_the_baseline_is_the_dense_choice_with_comfyuis_attention_or_comfyuis_attention_itself(tmp_path):
    """``dense_attention="fastest"``: the measured choice among SDPA and ComfyUI's function (here the function
    wins); ``comfyui``: ComfyUI's function as launched, untimed by the choice."""
    from adaptive_sparse_attention.kernels.dense.choice import DenseChoices
    from adaptive_sparse_attention.nodes.dense_override import DenseOverride

    calls = []

    def comfy_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                        skip_output_reshape=False, **kwargs):
        calls.append(heads)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def timer(fn):  # the host function is timed faster than SDPA
        before = len(calls)
        fn()
        return 1.0 if len(calls) > before else 2.0

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 96, 16, generator=g) for _ in range(3))
    name = f"ComfyUI's attention {__name__}.{comfy_attention.__qualname__}"
    override = DenseOverride(DenseChoices(tmp_path / "dense.json", timer=timer))
    run, label = override.baseline(q, k, v, comfy_attention, fastest=True)
    assert label == name
    calls.clear()
    assert run().equal(torch.nn.functional.scaled_dot_product_attention(q, k, v)) and calls == [2]
    run, label = override.baseline(q, k, v, comfy_attention, fastest=False)
    assert label == name and run() is not None and calls == [2, 2]
    run, label = override.baseline(q, k, v, None, fastest=False)
    assert label == "SDPA's own choice"
