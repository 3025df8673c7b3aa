"""The precision of a run: the node's `precision` setting, and what `auto` follows in ComfyUI.

`auto` runs 8-bit when ComfyUI itself runs 8-bit attention: the attention ComfyUI bound for the
model's blocks at import from its launch flags (``--use-sage-attention`` binds ``attention_sage``,
``--use-ck-attention`` binds ``attention_comfy_kitchen_int8``), the attention the user chose for the
model with ComfyUI's ModelAttentionBackend node (``ModelPatcher.set_model_optimized_attention``: an
override that runs one registered attention function, read here as that function, `model_choice`),
an attention override another node installed on the model, or (current upstream) the attention a block's own
attention module chose (``attn.comfy_attention``, a ComfyAttention whose ``function`` a checkpoint sets
through its ``blocks.N.attn.comfy_attention.config`` entry, e.g. comfy-kitchen INT8; `module_attention`),
which ComfyUI runs in place of the launch's unless an override is set. Functions are told apart by a stable identity (module and qualified
name): ComfyUI's own 8-bit functions by name, other packages' by the 8-bit packages they come from
or the 8-bit kernel their name carries (Sage, INT8, FP8). The engine only ever sees the resolved
value, "bf16" or "8-bit".
"""
from __future__ import annotations

import functools
import inspect
import re
import sys
from typing import Any, Callable, Sequence

ATTENTION_MODULE = "comfy.ldm.modules.attention"
# ComfyUI's own 8-bit attention functions -> what binds them
COMFY_EIGHT_BIT = {
    f"{ATTENTION_MODULE}.attention_sage": "the --use-sage-attention launch flag",
    f"{ATTENTION_MODULE}.attention3_sage": "SageAttention 3",
    f"{ATTENTION_MODULE}.attention_comfy_kitchen_int8": "the --use-ck-attention launch flag",
    f"{ATTENTION_MODULE}._attention_comfy_kitchen_int8_containers": "the --use-ck-attention launch flag",
}
# any other function whose identity matches computes in 8-bit: Sage's packages, comfy-kitchen's INT8 /
# FP8 / sol kernels, and patches named after them (e.g. another node's `attention_override_sage`)
EIGHT_BIT_NAME = re.compile(r"sageattention|sageattn|(^|[._<>])sage|int8|fp8|comfy_kitchen\.sol_attn", re.IGNORECASE)


def identity(fn: Any) -> str:
    """A stable name of an attention function: module and qualified name of what it wraps.

    Args:
        fn: a function, a ``functools.partial``, a wrapped function (``__wrapped__``) or a callable object.
    Returns:
        "module.qualname", e.g. "comfy.ldm.modules.attention.attention_sage".
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = inspect.unwrap(fn) if callable(fn) else fn
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}"


# the override ComfyUI's ModelPatcher.set_model_optimized_attention installs (ModelAttentionBackend)
MODEL_CHOICE = "comfy.model_patcher.ModelPatcher.set_model_optimized_attention.<locals>.optimized_attention_override"


def model_choice(override: Any) -> Callable | None:
    """The attention function an override runs when it is ComfyUI's ``set_model_optimized_attention``
    override (what ModelAttentionBackend sets: it ignores ComfyUI's function and calls the chosen one
    with the same arguments), else None.

    Args:
        override: a model's ``optimized_attention_override``, or None.
    Returns:
        the chosen attention function (e.g. ``attention_comfy_kitchen_int8``), or None.
    """
    if override is None or identity(override) != MODEL_CHOICE:
        return None
    cells = dict(zip(override.__code__.co_freevars, override.__closure__ or ()))
    cell = cells.get("optimized_attention")
    return None if cell is None else cell.cell_contents


def is_eight_bit(ident: str) -> bool:
    """Whether the attention function of this identity computes in 8-bit arithmetic."""
    return ident in COMFY_EIGHT_BIT or EIGHT_BIT_NAME.search(ident) is not None


def module_attention(attn: Any) -> Callable | None:
    """The attention function a block's attention module chose, else None.

    Current upstream gives each attention module a ``comfy_attention`` (ComfyAttention) and passes it to
    ``optimized_attention`` as ``preferred_attention``; its ``function`` is set from the checkpoint's
    ``blocks.N.attn.comfy_attention.config`` entry where that kernel runs on this device (None otherwise,
    and on the pinned fork, which has no such module: ComfyUI then runs the launch's attention).

    Args:
        attn: a block's attention module.
    Returns:
        the function ComfyUI runs for this module's calls when no override is set, or None.
    """
    return getattr(getattr(attn, "comfy_attention", None), "function", None)


def launch_attention(diffusion_model: Any) -> Callable | None:
    """The attention ComfyUI bound for this model's blocks: ``optimized_attention`` of the module that
    defines the model (H3's binds it at import, from the launch flags), else the attention module's."""
    for name in (type(diffusion_model).__module__, ATTENTION_MODULE):
        fn = getattr(sys.modules.get(name), "optimized_attention", None)
        if fn is not None:
            return fn
    return None


def resolve_precision(setting: str, attention: Callable | None, override: Callable | None,
                      modules: Sequence[Callable | None] = ()) -> tuple[str, str]:
    """The precision a run uses, and why, in the order ComfyUI decides what runs: an override, then the
    attention modules' own choices, then the launch's attention.

    Args:
        setting: the node's value: "auto", "bf16" or "8-bit".
        attention: the attention ComfyUI runs for the model's blocks (`launch_attention`), if known.
        override: another node's ``optimized_attention_override`` on the model (not ours), if any; it
            runs the blocks ComfyUI would run on `attention`. ModelAttentionBackend's (`model_choice`)
            counts as the attention it chose.
        modules: per DiT block, the attention its attention module chose (`module_attention`), or None;
            ComfyUI runs it in place of `attention` when no override is set. One block choosing an 8-bit
            function makes the run 8-bit (ComfyUI then runs 8-bit attention there).
    Returns:
        ("bf16" or "8-bit", the reason in words).
    """
    if setting != "auto":
        return setting, f"precision={setting} on the node"
    chosen = model_choice(override)
    if chosen is not None:
        ident = identity(chosen)
        bits = "8-bit" if is_eight_bit(ident) else "bf16"
        return bits, (f"auto: the model's attention backend (ModelAttentionBackend) is {ident}, which is "
                      f"{'' if bits == '8-bit' else 'not '}8-bit")
    if override is not None:
        ident = identity(override)
        bits = "8-bit" if is_eight_bit(ident) else "bf16"
        return bits, f"auto: another node's attention override {ident} is {'' if bits == '8-bit' else 'not '}8-bit"
    chosen = [fn for fn in modules if fn is not None]
    if chosen:
        eight_bit = [fn for fn in chosen if is_eight_bit(identity(fn))]
        bits = "8-bit" if eight_bit else "bf16"
        shown = eight_bit or chosen
        return bits, (f"auto: the attention modules of {len(shown)} of {len(modules)} blocks choose "
                      f"{identity(shown[0])} (the checkpoint's comfy_attention config), which is "
                      f"{'' if eight_bit else 'not '}8-bit")
    if attention is None:
        return "bf16", "auto: ComfyUI's attention function was not found"
    ident = identity(attention)
    if is_eight_bit(ident):
        how = COMFY_EIGHT_BIT.get(ident, "a patch of ComfyUI's attention")
        return "8-bit", f"auto: ComfyUI runs {ident} ({how}), which is 8-bit"
    return "bf16", f"auto: ComfyUI runs {ident}, which is not 8-bit"
