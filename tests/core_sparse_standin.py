"""Stand-in for ComfyUI's core "Model Sparse Attention" node where the checkout lacks it (0.33).

Only its patching behaviour, in the two forms upstream's comfy_extras/nodes_sparse_attention.py
has had: a clone of the model, an attention override in transformer_options, ON_PREPARE_STATE and
ON_CLEANUP callbacks under the key "block_sparse_attention", and one ("dit", "double_block", i)
replacement per H3 block set with set_model_patch_replace. The older form replaces what was there
and never calls it; the newer one (Comfy-Org/ComfyUI at cf3103c5) calls the replacement it found
and marks its own with `_block_sparse_attention_patch`, `_index` and `_previous` attributes. On the
CPU the real node's eligibility check fails (it needs CUDA and its kernel), so its block patch only
runs the next block and its override passes through; so do these. Loaded under the real module's
name, which is what the detection reads.
"""
from __future__ import annotations

import comfy.patcher_extension as pe

FORMS = ("replaces", "chains")


def make_attention_override(previous):
    def override(func, *args, **kwargs):
        return func(*args, **kwargs) if previous is None else previous(func, *args, **kwargs)
    return override


def install_override(transformer_options: dict) -> None:
    transformer_options["optimized_attention_override"] = make_attention_override(
        transformer_options.get("optimized_attention_override"))


def make_h3_block_patch(block_index, previous, form: str):
    def block_patch(args, extra):
        if form == "chains" and previous is not None:
            return previous(args, extra)
        return extra["original_block"](args)
    if form == "chains":
        block_patch._block_sparse_attention_patch = object()
        block_patch._block_sparse_attention_index = block_index
        block_patch._block_sparse_attention_previous = previous
    return block_patch


def apply_block_sparse_attention(model, form: str = "chains"):
    if form not in FORMS:
        raise ValueError(f"form={form!r}: expected one of {FORMS}")
    m = model.clone()
    install_override(m.model_options["transformer_options"])
    m.add_callback_with_key(pe.CallbacksMP.ON_PREPARE_STATE, "block_sparse_attention",
                            lambda patcher, timestep, model_options: None)
    m.add_callback_with_key(pe.CallbacksMP.ON_CLEANUP, "block_sparse_attention", lambda patcher: None)
    previous = dict(m.model_options["transformer_options"].get("patches_replace", {}).get("dit", {}))
    for i, block in enumerate(model.get_model_object("diffusion_model").blocks):
        m.set_model_patch_replace(make_h3_block_patch(i, previous.get(("double_block", i)), form),
                                  "dit", "double_block", i)
    return m
