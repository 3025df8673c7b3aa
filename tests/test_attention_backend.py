"""ComfyUI's ModelAttentionBackend (``ModelPatcher.set_model_optimized_attention``) without ComfyUI:
the attention it chose is read from its override, `auto` precision follows it as it follows a launch
flag, and the dense steps run it as a candidate in place of the launch's function.

test_comfyui_attention_backend.py runs the real node before and after ours.
"""
from __future__ import annotations

import torch
from attention_standins import ATTENTION, Patcher, comfy_function, launched

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.nodes.precision import MODEL_CHOICE, identity, model_choice, resolve_precision
from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook


def set_model_optimized_attention(optimized_attention):
    """The override ComfyUI's ModelPatcher.set_model_optimized_attention builds (same name and closure)."""
    def optimized_attention_override(_, *args, **kwargs):
        return optimized_attention(*args, **kwargs)
    optimized_attention_override.__module__ = "comfy.model_patcher"
    optimized_attention_override.__qualname__ = MODEL_CHOICE.removeprefix("comfy.model_patcher.")
    return optimized_attention_override


def test_the_chosen_function_is_read_from_comfyuis_override():
    ck = comfy_function("attention_comfy_kitchen_int8")
    assert model_choice(set_model_optimized_attention(ck)) is ck
    assert identity(set_model_optimized_attention(ck)) == MODEL_CHOICE
    assert model_choice(None) is None
    assert model_choice(comfy_function("attention_override_sage", "some_node.patches")) is None

    def optimized_attention_override(_, *args, **kwargs):  # the same name from another module: not ComfyUI's
        return None
    assert model_choice(optimized_attention_override) is None


def test_auto_follows_the_chosen_attention_and_explicit_settings_win():
    ck = set_model_optimized_attention(comfy_function("attention_comfy_kitchen_int8"))
    pytorch = set_model_optimized_attention(comfy_function("attention_pytorch"))
    assert resolve_precision("auto", comfy_function("attention_pytorch"), ck) == (
        "8-bit", f"auto: the model's attention backend (ModelAttentionBackend) is {ATTENTION}."
                 "attention_comfy_kitchen_int8, which is 8-bit")
    assert resolve_precision("auto", comfy_function("attention_sage"), pytorch) == (
        "bf16", f"auto: the model's attention backend (ModelAttentionBackend) is {ATTENTION}.attention_pytorch, "
                "which is not 8-bit")
    assert resolve_precision("bf16", None, ck) == ("bf16", "precision=bf16 on the node")


def test_the_dense_steps_run_the_chosen_attention_in_place_of_comfyuis(monkeypatch):
    chosen = comfy_function("attention_comfy_kitchen_int8", result="chosen")
    mab = set_model_optimized_attention(chosen)
    hook = SparseAttentionHook(SparseConfig())
    hook.on_pre_run(Patcher(launched(monkeypatch, "attention_pytorch"), override=mab))
    assert hook.dense_override.chosen is chosen
    assert hook.engine_config.precision == hook.dense_override.precision == "8-bit"
    args = {"img": None, "transformer_options": {"optimized_attention_override": mab}}
    attn = torch.nn.Module()  # the pinned fork's: no comfy_attention
    assert hook.dense_args(args, attn)["transformer_options"]["optimized_attention_override"] is hook.dense_override
    other = comfy_function("attention_override_sage", "some_node.patches")  # another node's override stays
    assert hook.dense_args({"transformer_options": {"optimized_attention_override": other}}, attn)[
        "transformer_options"]["optimized_attention_override"] is other
    launch = comfy_function("attention_pytorch", result="launch")
    q = torch.zeros(1, 2, 4, 8)
    masked = hook.dense_override(launch, q, q, q, 2, mask=torch.ones(4, 4), skip_reshape=True)
    assert masked == "chosen"  # a call the override does not serve goes to the chosen function, as without us

    hook.on_pre_run(Patcher(launched(monkeypatch, "attention_pytorch")))  # the next run without it
    assert hook.dense_override.chosen is None
    assert hook.dense_override(launch, q, q, q, 2, mask=torch.ones(4, 4), skip_reshape=True) == "launch"
