"""The `precision` setting: its validation, what `auto` follows in ComfyUI, and the engine seeing only bf16 or 8-bit."""
from __future__ import annotations

import functools
import sys

import pytest
from attention_standins import ATTENTION, Patcher, comfy_function, launched

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.nodes.dense_override import DenseOverride
from adaptive_sparse_attention.nodes.precision import identity, is_eight_bit, launch_attention, resolve_precision
from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook


def test_config_validates_precision():
    assert SparseConfig().precision == "auto"
    assert SparseConfig(precision="8-bit").precision == "8-bit"
    with pytest.raises(ValueError, match=r"SparseConfig\.precision='int8' is not allowed: expected one of 'auto', "
                                         r"'bf16', '8-bit'"):
        SparseConfig(precision="int8")
    with pytest.raises(ValueError, match=r"SparseConfig\.precision"):
        SparseConfig().replace(precision="fp8")


def test_identity_is_module_and_qualname_of_what_is_wrapped():
    sage = comfy_function("attention_sage")
    assert identity(sage) == f"{ATTENTION}.attention_sage"
    assert identity(functools.partial(sage, heads=2)) == f"{ATTENTION}.attention_sage"
    assert identity(DenseOverride(None)) == "adaptive_sparse_attention.nodes.dense_override.DenseOverride"


@pytest.mark.parametrize("ident,eight", [
    (f"{ATTENTION}.attention_sage", True), (f"{ATTENTION}.attention_comfy_kitchen_int8", True),
    (f"{ATTENTION}.attention3_sage", True), ("sageattention.core.sageattn", True),
    ("comfy_kitchen.int8_attention", True),
    ("kjnodes.nodes.PathchSageAttentionKJ.patch.<locals>.attention_override_sage", True),
    (f"{ATTENTION}.attention_pytorch", False), (f"{ATTENTION}.attention_flash", False),
    (f"{ATTENTION}.attention_xformers", False), ("somenode.usage_counter.wrapped_attention", False),
    ("othernode.message_attention", False)])
def test_eight_bit_functions_are_told_by_identity(ident, eight):
    assert is_eight_bit(ident) is eight


@pytest.mark.parametrize("bound,expected,says", [
    ("attention_sage", "8-bit", "--use-sage-attention launch flag"),
    ("attention_comfy_kitchen_int8", "8-bit", "--use-ck-attention launch flag"),
    ("attention_pytorch", "bf16", "not 8-bit"), ("attention_flash", "bf16", "not 8-bit")])
def test_auto_follows_comfyui_launch(bound, expected, says):
    precision, why = resolve_precision("auto", comfy_function(bound), None)
    assert precision == expected
    assert says in why
    assert f"{ATTENTION}.{bound}" in why


def test_auto_follows_another_nodes_override_and_explicit_settings_win():
    pytorch = comfy_function("attention_pytorch")
    sage_patch = comfy_function("attention_override_sage", "some_node.patches")
    assert resolve_precision("auto", pytorch, sage_patch) == (
        "8-bit", "auto: another node's attention override some_node.patches.attention_override_sage is 8-bit")
    assert resolve_precision("auto", comfy_function("attention_sage"), comfy_function("plain", "x"))[0] == "bf16"
    assert resolve_precision("bf16", comfy_function("attention_sage"), None) == ("bf16", "precision=bf16 on the node")
    assert resolve_precision("8-bit", pytorch, None) == ("8-bit", "precision=8-bit on the node")
    assert resolve_precision("auto", None, None)[0] == "bf16"


@pytest.fixture
def launch(monkeypatch):
    """A model class whose module bound `optimized_attention` as ComfyUI's H3 module does at import."""
    def model(bound: str):
        model = launched(monkeypatch, bound)
        assert launch_attention(model) is sys.modules["fake_h3_model"].optimized_attention
        return model
    return model


@pytest.mark.parametrize("setting,bound,expected", [
    ("auto", "attention_sage", "8-bit"), ("auto", "attention_pytorch", "bf16"), ("bf16", "attention_sage", "bf16"),
    ("8-bit", "attention_pytorch", "8-bit")])
def test_the_engine_and_the_dense_override_get_the_resolved_precision(launch, setting, bound, expected):
    hook = SparseAttentionHook(SparseConfig(precision=setting))
    assert hook.engine_config.precision in ("bf16", "8-bit")
    assert hook.config.precision == setting
    hook.on_pre_run(Patcher(launch(bound)))
    assert hook.engine_config.precision == hook.dense_override.precision == expected
    assert hook.tracker.precision[0] == expected  # auto stays auto
    assert hook.config.precision == setting
    twin = hook.on_model_patcher_clone()  # a clone resolves its own precision
    assert twin.config.precision == setting
    assert twin.dense_override is not hook.dense_override


def test_our_own_override_is_not_another_nodes(launch):
    hook = SparseAttentionHook(SparseConfig())
    hook.on_pre_run(Patcher(launch("attention_pytorch"), override=hook.dense_override))
    assert hook.tracker.precision == ("bf16", f"auto: ComfyUI runs {ATTENTION}.attention_pytorch, which is not 8-bit")
