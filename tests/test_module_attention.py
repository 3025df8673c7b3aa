"""Today's upstream H3: each attention module's own attention choice (``attn.comfy_attention``, set by the
checkpoint) is a dense candidate and decides `precision auto`, as the launch's attention does; the
dense-kernel measurement runs outside ComfyUI's allocation graph. The stand-in of today's block is
h3_upstream.py; the pinned fork's (h3_block.py) has no such module and follows the launch.
"""
from __future__ import annotations

import functools

import pytest
import torch
from attention_standins import ATTENTION, Patcher, comfy_function
from h3_harness import PACKED, config, model_of, options, reference, run_model
from h3_block import block_args, malloc_graph_standin
import h3_upstream
from h3_upstream import sdpa_function, upstream_model

from adaptive_sparse_attention.kernels.dense import choice as dense
from adaptive_sparse_attention.nodes.dense_override import DenseOverride, PreferredOverride
from adaptive_sparse_attention.nodes.precision import module_attention, resolve_precision
from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook
from test_attention_backend import set_model_optimized_attention

CK = f"{ATTENTION}.attention_comfy_kitchen_int8"
FACTOR = 1 + 2 ** -9  # beyond a bf16 run's bound, within an 8-bit run's
INT8_REASON = (f"auto: the attention modules of 2 of 2 blocks choose {CK} (the checkpoint's comfy_attention "
               "config), which is 8-bit")


@pytest.fixture
def ck(monkeypatch):
    """comfy-kitchen's INT8 attention where it runs (the stand-in's KERNELS); returns the list of its calls."""
    calls: list = []
    monkeypatch.setitem(h3_upstream.KERNELS, "comfy_kitchen_int8",
                        sdpa_function("attention_comfy_kitchen_int8", calls, FACTOR))
    return calls


def timed(calls: list):
    """A timer on which a thunk that called the stand-in in `calls` is the fastest."""
    def timer(fn):
        before = len(calls)
        fn()
        return 1.0 if len(calls) > before else 2.0
    return timer


def dense_run(model, precision: str, calls: list):
    """Every step dense through our node on `model`; returns (output, hook)."""
    hook = SparseAttentionHook(config(warmup_mode="dense", precision=precision))
    hook.dense_choices.timer = timed(calls)
    hook.on_pre_run(Patcher(model))
    args = block_args(model.blocks[0], PACKED, seed=31, new=True)
    args["transformer_options"] = options()
    return run_model(model, hook, args, True), hook, args


def test_the_checkpoint_sets_each_modules_choice(ck):
    model = upstream_model(seed=30, choose="comfy_kitchen_int8")
    assert [module_attention(b.attn) for b in model.blocks] == [h3_upstream.KERNELS["comfy_kitchen_int8"]] * 2
    assert all(b.attn.comfy_attention.config == {"attention": "comfy_kitchen_int8"} for b in model.blocks)
    assert [module_attention(b.attn) for b in upstream_model(seed=30).blocks] == [None, None]
    assert module_attention(model_of(True).blocks[0].attn) is None  # the pinned fork has no comfy_attention


def test_a_checkpoint_choosing_int8_makes_auto_8bit_and_runs_its_kernel_in_the_dense_steps(ck):
    model = upstream_model(seed=30, choose="comfy_kitchen_int8")
    out, hook, args = dense_run(model, "auto", ck)
    assert hook.tracker.precision == ("8-bit", INT8_REASON)
    assert hook.engine_config.precision == hook.dense_override.precision == "8-bit"
    plain = reference(model, args, lambda block: block.attn)  # ComfyUI without our node: the module's choice
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    ours = [kw for kw in ck if "optimized_attention_override" in kw.get("transformer_options", {})]
    assert ours and all(kw["_inside_attn_wrapper"] is True for kw in ours)  # called as a candidate by our override


def test_precision_bf16_refuses_the_modules_8bit_choice(ck, caplog):
    model = upstream_model(seed=30, choose="comfy_kitchen_int8")
    with caplog.at_level("INFO", logger="adaptive_sparse_attention"):
        out, hook, args = dense_run(model, "bf16", ck)
    assert hook.tracker.precision == ("bf16", "precision=bf16 on the node")
    assert not any("optimized_attention_override" in kw.get("transformer_options", {}) for kw in ck)
    said = [r.getMessage() for r in caplog.records]
    assert any(f"dense kernel ComfyUI's attention {CK} is not a candidate: it computes in 8-bit" in m for m in said)
    plain = reference(model, args, lambda block: block.attn)
    assert not torch.equal(out, plain)
    torch.testing.assert_close(out, plain, rtol=1e-2, atol=1e-2)  # SDPA's, not the module's


@pytest.mark.parametrize("upstream", ["today", "pinned"])
def test_without_a_module_choice_auto_follows_the_launch(ck, upstream):
    model = upstream_model(seed=30) if upstream == "today" else model_of(True, seed=30)
    hook = SparseAttentionHook(config(warmup_mode="dense"))
    hook.on_pre_run(Patcher(model))
    expected = (f"auto: ComfyUI runs {ATTENTION}.attention_pytorch, which is not 8-bit" if upstream == "today"
                else "auto: ComfyUI's attention function was not found")  # h3_block binds none
    assert hook.tracker.precision == ("bf16", expected)


def test_precision_follows_comfyuis_order_override_then_modules_then_launch():
    ck_fn, pytorch = comfy_function("attention_comfy_kitchen_int8"), comfy_function("attention_pytorch")
    sage = comfy_function("attention_sage")
    assert resolve_precision("auto", pytorch, None, [ck_fn, ck_fn]) == ("8-bit", INT8_REASON)
    assert resolve_precision("auto", sage, None, [None, pytorch, None]) == (
        "bf16", f"auto: the attention modules of 1 of 3 blocks choose {ATTENTION}.attention_pytorch (the "
                "checkpoint's comfy_attention config), which is not 8-bit")
    assert resolve_precision("auto", pytorch, None, [None, ck_fn])[0] == "8-bit"  # one 8-bit block suffices
    assert resolve_precision("auto", sage, None, [None, None])[0] == "8-bit"  # no module choice: the launch's
    mab = set_model_optimized_attention(pytorch)  # ModelAttentionBackend's override wins, as in ComfyUI
    assert resolve_precision("auto", pytorch, mab, [ck_fn, ck_fn])[0] == "bf16"
    assert resolve_precision("bf16", pytorch, None, [ck_fn]) == ("bf16", "precision=bf16 on the node")


def test_the_modules_choice_stands_in_for_comfyuis_function_below_modelattentionbackends():
    module_fn = comfy_function("attention_comfy_kitchen_int8", result="module")
    override = DenseOverride(dense.DenseChoices())
    bound = override.preferring(module_fn)
    assert isinstance(bound, PreferredOverride) and override.preferring(module_fn) is bound
    assert override.preferring(None) is override
    launch = comfy_function("attention_pytorch", result="launch")
    q = torch.zeros(1, 2, 4, 8)
    assert bound(launch, q, q, q, 2, mask=torch.ones(4, 4), skip_reshape=True) == "module"  # as without us
    override.chosen = comfy_function("attention_sage", result="chosen")
    assert bound(launch, q, q, q, 2, mask=torch.ones(4, 4), skip_reshape=True) == "chosen"


def test_the_dense_kernel_measurement_runs_outside_comfyuis_allocation_graph(ck, monkeypatch):
    """Today's upstream records an H3 forward's allocations (comfy.model_prefetch, the pinned fork has none):
    the measurement's scratch must not come from that record; the dense call itself runs in it."""
    depth = malloc_graph_standin(monkeypatch)
    seen = []
    reference_attention = dense.reference_attention
    monkeypatch.setattr(dense, "reference_attention", lambda *a: seen.append(len(depth)) or reference_attention(*a))
    ck_depth = []
    kernel = h3_upstream.KERNELS["comfy_kitchen_int8"]

    @functools.wraps(kernel)  # keeps its name: still comfy-kitchen's INT8
    def recorded(*args, **kwargs):
        ck_depth.append(len(depth))
        return kernel(*args, **kwargs)
    monkeypatch.setitem(h3_upstream.KERNELS, "comfy_kitchen_int8", recorded)
    model = upstream_model(seed=30, choose="comfy_kitchen_int8")
    dense_run(model, "auto", ck)
    assert seen == [1]  # one bucket measured, paused
    assert 1 in ck_depth and ck_depth[-1] == 0  # timed paused; the block calls after it in the graph
    assert not depth
