"""The hook framework: ComfyUI's MiniMax-H3 DiT blocks hand chosen attention calls to a hook.

Every block i gets a ``("dit", "double_block", i)`` replacement (the patch point H3's forward
offers; H3 sets no block index, so i is bound here). The replacement decides, per call, whether
a hook takes over the block's attention; the rest of the block (adaLN modulation, norms, gated
residuals, MLP) always runs as the model's own code, through ``extra["original_block"]`` (or the
replacement that was registered before ours, which is chained, not dropped; ComfyUI's core
"Model Sparse Attention" node is refused in either order, see `refuse_core_sparse`). How the hook's
attention gets into the block depends on the upstream signature:

- current upstream (``DiTBlock.forward(..., attention=None)``; block args carry ``"layout"`` and
  ``"attention"``): the replacement passes a copy of args whose ``"attention"`` is the hook's
  attention module; the block calls it instead of ``self.attn``.
- older upstream (no ``attention`` argument): each block's ``attn.forward`` is object-patched
  (through the ModelPatcher, so it is undone on unpatch) with a dispatcher that runs the hook
  only when the block replacement marked this call in its copy of ``transformer_options`` and
  otherwise calls whatever forward was there before (the class's, or another node's patch such
  as KJNodes' low-VRAM attention).

Either way the hook receives the block's attention input and produces Q/K/V itself from the
layer's weights (`backend/producer.py`); it is not an ``optimized_attention_override``, so nothing
can recurse. The calls it does not take (dense blocks) get, on a copy of their
``transformer_options``, an override that runs ComfyUI's Q/K/V on the fastest exact dense kernel
(`kernels/dense.py`), unless the config keeps ComfyUI's path or another node's override is set.

The packed-sequence layout comes from the block args (``args["layout"]``, current upstream),
``transformer_options["minimax_h3_layout"]``, or a DIFFUSION_MODEL wrapper that reads
``minimax_payload["layout"]`` (older upstream); conversions are cached per signature (bounded).

Under torch.compile (ComfyUI's TorchCompileModel compiles the whole diffusion model, these hooks
included) the step is read on the host once per model call and every block's decision is made
there too (`BlockHook.begin_call`), published in the module global `COMPILED_CALLS`, so the
compiled blocks hold no host synchronisation and no decision baked in through the guards that
TorchCompileModel drops (all under ``transformer_options``).
"""
from __future__ import annotations

import inspect
import itertools
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..backend.layout import SequenceLayout
from .comfy_weights import unwrap_input
from .core_sparse import double_block_patches, refuse_core_sparse
from .h3_model import LayoutCache, check_h3, payload_layout
from .run_tracker import RunTracker

log = logging.getLogger("adaptive_sparse_attention")

_ids = itertools.count()
# Hook key -> the block tokens of the model call now running under torch.compile. ComfyUI's
# TorchCompileModel drops every guard whose source passes through transformer_options (the block
# patches, the hooks and their state included), so a decision read there would be baked into the
# compiled graph; this module global keeps its guards: a changed decision recompiles.
COMPILED_CALLS: dict[str, tuple] = {}



@dataclass
class CallContext:
    """What one model call shares with all its blocks."""

    step: int | None
    total: int | None
    packed: Any = None  # the PackedLayout found by the DIFFUSION_MODEL wrapper, if any




class BlockHook(ABC):
    """Base of a hook that takes over the attention of chosen H3 block calls.

    Subclasses implement `decide` (which calls, returning a token or None) and `attend` (the
    attention output [S, hidden] of a taken call, out_proj included). The base keeps the per-run
    state: step counting, layout discovery and the run tracker.
    """

    name = "hook"

    def __init__(self) -> None:
        self.key = f"adaptive_sparse_attention.{self.name}.{next(_ids)}"
        self.tracker = RunTracker(self.title)
        self.layouts = LayoutCache()

    @property
    def title(self) -> str:
        """The hook's name in log messages and errors."""
        return type(self).__name__

    # --- per-call plumbing -------------------------------------------------------------------
    def diffusion_model_wrapper(self, executor: Any, x: Any, timestep: Any, context: torch.Tensor,
                                transformer_options: dict, *args: Any, **kwargs: Any) -> Any:
        """DIFFUSION_MODEL wrapper: finds the step and the layout once per model call (`begin_call`)."""
        transformer_options[self.key] = self.begin_call(executor.class_obj, x, context, transformer_options,
                                                        kwargs.get("minimax_payload") or {},
                                                        torch.compiler.is_compiling())
        try:
            return executor(x, timestep, context, transformer_options, *args, **kwargs)
        finally:
            transformer_options.pop(self.key, None)
            COMPILED_CALLS.pop(self.key, None)

    @torch.compiler.disable
    def begin_call(self, model: Any, x: Any, context: torch.Tensor, transformer_options: dict, payload: dict,
                   compiled: bool) -> CallContext:
        """The `CallContext` of a model call; under torch.compile also the plan of all its blocks.

        It always runs eagerly: the step comes from the sigmas on the host, which is one graph break
        per model call under torch.compile (H3's forward reads its sigma on the host there too).
        `compiled` says whether the model call is being compiled; then `plan_call` decides every
        block here and its tokens go to `COMPILED_CALLS`, where the compiled blocks read them.
        """
        step, total = self.tracker.step_of(transformer_options)
        packed = None
        try:
            packed = payload_layout(model, x, context, payload)
        except Exception as err:  # layout discovery must never break sampling; blocks report it
            self.tracker.log_once(f"could not rebuild the packed layout from minimax_payload ({err})")
        ctx = CallContext(step, total, packed)
        if compiled:
            tokens = self.plan_call(model, ctx, context.dtype, x[0].device, transformer_options)
            if tokens is not None:
                COMPILED_CALLS[self.key] = tokens
        return ctx

    def plan_call(self, model: Any, ctx: CallContext, dtype: torch.dtype, device: torch.device,
                  transformer_options: dict) -> tuple | None:
        """Under torch.compile: the token (or None) of every block of this call, counted here; or None
        to let each block `decide` (the default)."""
        return None

    def token(self, layer: int, attn: torch.nn.Module, args: dict) -> Any:
        """The token of a block call: planned for the whole call under torch.compile, else `decide`."""
        planned = COMPILED_CALLS.get(self.key)
        return planned[layer] if planned is not None else self.decide(layer, attn, args)

    def call_context(self, transformer_options: dict) -> CallContext:
        """The `CallContext` the DIFFUSION_MODEL wrapper stored for this model call (built here, and
        the step counted, when the wrapper did not run)."""
        ctx = transformer_options.get(self.key)
        if not isinstance(ctx, CallContext):  # wrapper bypassed: count the step here, once per call
            ctx = CallContext(*self.tracker.step_of(transformer_options))
            transformer_options[self.key] = ctx
        return ctx

    def layout(self, args: dict, ctx: CallContext) -> SequenceLayout | None:
        """The call's layout: from the block args, transformer_options or the wrapper, else None."""
        to = args.get("transformer_options", {})
        for packed in (args.get("layout"), to.get("minimax_h3_layout"), ctx.packed):
            if packed is not None:
                return self.layouts.of(packed)
        return None

    def dense_args(self, args: dict) -> dict:
        """The block args of a call this hook does not take (unchanged here)."""
        return args

    def on_pre_run(self, patcher: Any = None) -> None:
        """Start of sampling: end the previous run and refuse ComfyUI's core sparse node applied after
        this one."""
        self.tracker.finish()
        COMPILED_CALLS.pop(self.key, None)
        if patcher is not None:  # a node applied after this one may have replaced its block patches
            refuse_core_sparse(patcher.model_options, self.title, "after")

    def on_cleanup(self, patcher: Any = None) -> None:
        """End of sampling: end the run (its report is kept)."""
        self.tracker.finish()
        COMPILED_CALLS.pop(self.key, None)

    # --- subclass contract -------------------------------------------------------------------
    @abstractmethod
    def decide(self, layer: int, attn: torch.nn.Module, args: dict) -> Any:
        """A token when this hook takes the call's attention (passed on to `attend`), else None."""

    @abstractmethod
    def attend(self, layer: int, token: Any, attn: torch.nn.Module, x: Any, rope_freqs: Any,
               transformer_options: dict, fallback: Callable) -> torch.Tensor:
        """The attention output [S, hidden] (out_proj applied) of block input x; `fallback` is the
        attention that would have run (same call signature as ``attn``)."""


class HookedAttention:
    """Stands in for a block's ``attn`` for one call (current upstream's ``args["attention"]``)."""

    def __init__(self, hook: BlockHook, layer: int, token: Any, attn: torch.nn.Module, fallback: Callable):
        self.hook, self.layer, self.token, self.attn, self.fallback = hook, layer, token, attn, fallback

    def __call__(self, x: Any, rope_freqs: Any = None, transformer_options: dict = {}) -> torch.Tensor:  # noqa: B006
        return self.hook.attend(self.layer, self.token, self.attn, x, rope_freqs, transformer_options, self.fallback)


class AttentionDispatch:
    """Object patch for ``blocks.{i}.attn.forward`` (older upstream): runs the hook on marked calls."""

    def __init__(self, hook: BlockHook, layer: int, attn: torch.nn.Module, previous: Callable | None):
        self.hook, self.layer, self.attn = hook, layer, attn
        self.fallback = previous if previous is not None else self.model_forward

    def model_forward(self, x: Any, rope_freqs: Any = None, transformer_options: dict = {}) -> torch.Tensor:  # noqa: B006
        """The class's own forward; it takes a tensor, so a low-VRAM block forward's list is unwrapped."""
        if isinstance(x, list):
            self.hook.tracker.log_once(
                "KJNodes' low-VRAM attention was applied after this node and kept its attention patch: dense blocks "
                "use ComfyUI's attention without head chunks (sparse blocks still use them); place the low-VRAM "
                "node before this one to keep its attention in dense blocks")
        return type(self.attn).forward(self.attn, unwrap_input(x), rope_freqs=rope_freqs,
                                       transformer_options=transformer_options)

    def __call__(self, x: Any, rope_freqs: Any = None, transformer_options: dict = {}) -> torch.Tensor:  # noqa: B006
        mark = transformer_options.get(self.hook.key)
        if isinstance(mark, tuple) and mark[0] == self.layer:
            return self.hook.attend(self.layer, mark[1], self.attn, x, rope_freqs, transformer_options, self.fallback)
        return self.fallback(x, rope_freqs=rope_freqs, transformer_options=transformer_options)


def takes_attention_arg(forward: Callable) -> bool:
    """Whether a block forward accepts current upstream's ``attention`` argument."""
    try:
        return "attention" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


class BlockReplacement:
    """The ``("dit", "double_block", layer)`` replacement of one block."""

    def __init__(self, hook: BlockHook, layer: int, attn: torch.nn.Module, via_args: bool,
                 previous: Callable | None):
        self.hook, self.layer, self.attn, self.via_args, self.previous = hook, layer, attn, via_args, previous

    def __call__(self, args: dict, extra: dict) -> dict:
        def inner(a: dict) -> dict:
            return self.previous(a, extra) if self.previous is not None else extra["original_block"](a)

        current = args.get("attention")
        if isinstance(current, HookedAttention):  # a hook nearer the sampler already took this call
            return inner(args)
        token = self.hook.token(self.layer, self.attn, args)
        if token is None:
            return inner(self.hook.dense_args(args))
        args = dict(args)
        if self.via_args:
            if current is not None:
                self.hook.tracker.log_once("the block attention set by another patch is replaced in the calls "
                                           f"{self.hook.title} takes over")
            args["attention"] = HookedAttention(self.hook, self.layer, token, self.attn,
                                                current if current is not None else self.attn)
        else:
            to = dict(args["transformer_options"])
            to[self.hook.key] = (self.layer, token)
            args["transformer_options"] = to
        return inner(args)


def block_hooks(diffusion_model: Any, hook: BlockHook, previous_replacements: dict,
                object_patches: dict) -> tuple[dict[int, BlockReplacement], dict[str, AttentionDispatch]]:
    """Replacements per block index and the attn.forward object patches (older upstream only).

    `previous_replacements` maps block index -> an earlier ("dit", "double_block", i) patch to
    chain; `object_patches` are the ModelPatcher's current object patches.
    """
    replacements, patches = {}, {}
    for i, block in enumerate(diffusion_model.blocks):
        forward = object_patches.get(f"diffusion_model.blocks.{i}.forward", type(block).forward)
        via_args = takes_attention_arg(forward)
        replacements[i] = BlockReplacement(hook, i, block.attn, via_args, previous_replacements.get(i))
        if not via_args:
            key = f"diffusion_model.blocks.{i}.attn.forward"
            patches[key] = AttentionDispatch(hook, i, block.attn, object_patches.get(key))
    return replacements, patches



def install(model_patcher: Any, hook: BlockHook) -> Any:
    """A clone of `model_patcher` whose H3 blocks run `hook` (plus its wrapper and callbacks)."""
    import comfy.patcher_extension as pe

    diffusion_model = model_patcher.get_model_object("diffusion_model")
    check_h3(diffusion_model)
    refuse_core_sparse(model_patcher.model_options, hook.title, "before")
    m = model_patcher.clone()
    previous = double_block_patches(m.model_options)
    replacements, patches = block_hooks(diffusion_model, hook, previous, m.object_patches)
    for i, fn in replacements.items():
        m.set_model_patch_replace(fn, "dit", "double_block", i)
    for key, fn in patches.items():
        m.add_object_patch(key, fn)
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, hook.key, hook.diffusion_model_wrapper)
    m.add_callback_with_key(pe.CallbacksMP.ON_PRE_RUN, hook.key, hook.on_pre_run)
    m.add_callback_with_key(pe.CallbacksMP.ON_CLEANUP, hook.key, hook.on_cleanup)
    return m




def hooks_of(model_patcher: Any) -> list[BlockHook]:
    """The hooks this pack installed on `model_patcher` (found through their DIFFUSION_MODEL wrappers)."""
    import comfy.patcher_extension as pe

    wrappers = getattr(model_patcher, "wrappers", {}).get(pe.WrappersMP.DIFFUSION_MODEL, {})
    return [fn.__self__ for fns in wrappers.values() for fn in fns if isinstance(getattr(fn, "__self__", None), BlockHook)]


