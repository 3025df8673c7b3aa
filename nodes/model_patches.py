"""What a `BlockHook` registers on a ModelPatcher, and installing it.

Every block i gets a ``("dit", "double_block", i)`` replacement (the patch point H3's forward
offers; H3 sets no block index, so i is bound here). The replacement decides, per call, whether
the hook takes over the block's attention; the rest of the block (adaLN modulation, norms, gated
residuals, MLP) always runs as the model's own code, through ``extra["original_block"]`` (or the
replacement that was registered before ours, which is chained, not dropped; ComfyUI's core
"Model Sparse Attention" node in either order is the hook's to handle, `BlockHook.check_core_sparse`). How the
hook's attention gets into the block depends on the upstream signature:

- current upstream (``DiTBlock.forward(..., attention=None)``): the replacement passes a copy of
  args whose ``"attention"`` is the hook's attention; the block calls it instead of ``self.attn``.
- older upstream (no ``attention`` argument): each block's ``attn.forward`` is object-patched
  (through the ModelPatcher, so it is undone on unpatch) with a dispatcher that runs the hook only
  when the block replacement marked this call in its copy of ``transformer_options`` and otherwise
  calls whatever forward was there before (the class's, or another node's patch such as KJNodes'
  low-VRAM attention).

Under torch.compile the replacement, the dispatcher and the hooked attention are frames torch.compile
skips (`torch.compiler.disable`; the first two non-recursively): they decide per call on the host,
from values a compiled frame could not guard on (TorchCompileModel drops every guard under
``transformer_options``), and what they call of ComfyUI's (the original block, ComfyUI's attention in
dense calls) is compiled as it is without this pack.

Two of the pack's hooks of different kinds on one model (the capture node's and the sparse node's)
both run on a call both take, in either node order: the observer's attention (`BlockHook.observes`)
stays outermost and passes the call on to the other's (`stacked`, `dispatch_over`).

These callables are shared by every clone of the patched model (ComfyUI copies model_options by
reference), so they hold only the hook's key, the block index and the chained patch; the hook
and the attention modules come from the call (`CallContext`, stored under the key by the
DIFFUSION_MODEL wrapper from the diffusion model it runs).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from ..notices import logger
from .comfy_weights import unwrap_input
from .core_sparse import double_block_patches
from .h3_model import check_h3
from .block_hook import BlockHook, CallContext, Mark, bind, bound_hook

log = logger()


def call_context(transformer_options: dict, key: str) -> CallContext:
    """The `CallContext` the DIFFUSION_MODEL wrapper stored for this model call under `key`."""
    ctx = transformer_options.get(key)
    if isinstance(ctx, Mark):
        return ctx.ctx
    if not isinstance(ctx, CallContext):
        raise RuntimeError(f"{key}: an H3 block ran without this pack's DIFFUSION_MODEL wrapper around the model "
                           "call (another node's wrapper did not call the model through ComfyUI's executor)")
    return ctx


class DiffusionModelWrapper:
    """DIFFUSION_MODEL wrapper: finds the hook of the diffusion model it runs, then the step and the
    layout, once per model call (`BlockHook.begin_call`)."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, executor: Any, x: Any, timestep: Any, context: torch.Tensor, transformer_options: dict,
                 *args: Any, **kwargs: Any) -> Any:
        model = executor.class_obj
        transformer_options[self.key] = bound_hook(model, self.key).begin_call(
            model, x, context, transformer_options, kwargs.get("minimax_payload") or {})
        try:
            return executor(x, timestep, context, transformer_options, *args, **kwargs)
        finally:
            transformer_options.pop(self.key, None)


class PreRun:
    """ON_PRE_RUN callback: binds the sampled patcher's own hook to its diffusion model."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, patcher: Any) -> None:
        hook = patcher.get_attachment(self.key)
        if hook is not None:
            bind(patcher.get_model_object("diffusion_model"), hook)
            hook.on_pre_run(patcher)


class Cleanup:
    """ON_CLEANUP callback: the end of one sampler call on the patcher."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, patcher: Any) -> None:
        hook = patcher.get_attachment(self.key)
        if hook is not None:
            hook.on_cleanup(patcher)


class HookedAttention:
    """Stands in for a block's ``attn`` for one call (current upstream's ``args["attention"]``).

    Skipped by torch.compile, with all it calls: traced, its layer would be a guard of the compiled
    block (one recompile per block), and the planner's host-side decisions and per-layout caches
    would split the hook's attention into many small guarded graphs, for kernels inductor cannot
    improve."""

    def __init__(self, hook: BlockHook, layer: int, token: Any, attn: torch.nn.Module, fallback: Callable):
        self.hook, self.layer, self.token, self.attn, self.fallback = hook, layer, token, attn, fallback

    @torch.compiler.disable
    def __call__(self, x: Any, rope_freqs: Any = None, transformer_options: dict = {}) -> torch.Tensor:  # noqa: B006
        return self.hook.attend(self.layer, self.token, self.attn, x, rope_freqs, transformer_options, self.fallback)


class AttentionDispatch:
    """Object patch for ``blocks.{i}.attn.forward`` (older upstream): runs the hook on marked calls
    (`observes`: the hook of this key is an observer, `BlockHook.observes`)."""

    def __init__(self, key: str, layer: int, previous: Callable | None, observes: bool = False):
        self.key, self.layer, self.previous, self.observes = key, layer, previous, observes

    @torch.compiler.disable(recursive=False)
    def __call__(self, x: Any, rope_freqs: Any = None, transformer_options: dict = {}) -> torch.Tensor:  # noqa: B006
        forward, x = self.route(x, transformer_options)
        return forward(x, rope_freqs=rope_freqs, transformer_options=transformer_options)

    @torch.compiler.disable
    def route(self, x: Any, transformer_options: dict) -> tuple[Callable, Any]:
        """(the attention this call runs, its input): the hook's for a taken call, else `dense`'s."""
        mark = transformer_options.get(self.key)
        if isinstance(mark, CallContext) and mark.hook.leaves_attention:  # e.g. to the core sparse node
            attn = mark.attn(self.layer)
            return self.previous or functools.partial(type(attn).forward, attn), unwrap_input(x)
        if not (isinstance(mark, Mark) and mark.layer == self.layer):
            raise RuntimeError(f"{self.key}: block {self.layer}'s attention ran without this pack's block "
                               "replacement (another node's replacement of the block dropped it)")
        if mark.token is not None:
            def fallback(y: Any, rope_freqs: Any = None, transformer_options: dict = {}) -> torch.Tensor:  # noqa: B006
                forward, y = self.dense(mark, y)
                return forward(y, rope_freqs=rope_freqs, transformer_options=transformer_options)
            return HookedAttention(mark.ctx.hook, self.layer, mark.token, mark.attn, fallback), x
        return self.dense(mark, x)

    def dense(self, mark: Mark, x: Any) -> tuple[Callable, Any]:
        """The forward that was there before (another node's patch), else the class's own; the class's
        takes a tensor, so a low-VRAM block forward's list is unwrapped."""
        if self.previous is not None:
            return self.previous, x
        if isinstance(x, list):
            mark.ctx.hook.tracker.log_once(
                "KJNodes' low-VRAM attention was applied after this node and kept its attention patch: dense blocks "
                "use ComfyUI's attention without head chunks (sparse blocks still use them); place the low-VRAM "
                "node before this one to keep its attention in dense blocks")
        return functools.partial(type(mark.attn).forward, mark.attn), unwrap_input(x)


def takes_attention_arg(forward: Callable) -> bool:
    """Whether a block forward accepts current upstream's ``attention`` argument."""
    try:
        return "attention" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


class BlockReplacement:
    """The ``("dit", "double_block", layer)`` replacement of one block.

    `swap` says how a taken call's attention reaches the block: through args (current upstream),
    through the mark an `AttentionDispatch` reads (older upstream), or not at all (None: the mark
    alone, read by an attention set elsewhere, e.g. Raylight's processor).
    """

    def __init__(self, key: str, layer: int, via_args: bool | None, previous: Callable | None):
        self.key, self.layer, self.via_args, self.previous = key, layer, via_args, previous

    @torch.compiler.disable(recursive=False)
    def __call__(self, args: dict, extra: dict) -> dict:
        args = self.route(args)
        return self.previous(args, extra) if self.previous is not None else extra["original_block"](args)

    @torch.compiler.disable
    def route(self, args: dict) -> dict:
        """The block args of this call: decided by the hook (`BlockHook.decide`), with its attention
        (or the mark for it) when it takes the call, else with the dense attention it chooses."""
        current = args.get("attention")
        taken = isinstance(current, HookedAttention)
        ctx = call_context(args.get("transformer_options", {}), self.key)
        hook, attn = ctx.hook, ctx.attn(self.layer)
        if taken and not (hook.observes or current.hook.observes):  # a hook nearer the sampler took this call
            return args
        token = hook.decide(self.layer, attn, args, ctx)
        if token is None:
            args = hook.dense_args(args, attn)
        elif self.via_args:
            if current is not None and not taken:
                hook.tracker.log_once("the block attention set by another patch is replaced in the calls "
                                      f"{hook.title} takes over")
            return dict(args, attention=stacked(HookedAttention(hook, self.layer, token, attn, attn), current))
        if self.via_args:
            return args
        to = dict(args["transformer_options"])
        to[self.key] = Mark(self.layer, token, attn, ctx)
        return dict(args, transformer_options=to)


def stacked(taken: HookedAttention, current: Any) -> HookedAttention:
    """The attention of a call `taken.hook` takes, over `current` (the block attention set before it:
    None, another patch's, or a hook's): an observer hook's attention stays outermost and passes the
    call on, so an observer and a hook that computes the attention both run, in either node order."""
    if isinstance(current, HookedAttention) and current.hook.observes and not taken.hook.observes:
        inner = HookedAttention(taken.hook, taken.layer, taken.token, taken.attn, current.fallback)
        return HookedAttention(current.hook, current.layer, current.token, current.attn, inner)
    taken.fallback = current if current is not None else taken.attn
    return taken


def dispatch_over(earlier: Any, hook: BlockHook, layer: int) -> AttentionDispatch:
    """The ``attn.forward`` object patch of `hook` over `earlier` (the patch there before, or None): an
    earlier one of the same kind is replaced, and an observer's stays outermost (as in `stacked`)."""
    if ours(earlier, hook.key):
        earlier = earlier.previous
    if isinstance(earlier, AttentionDispatch) and earlier.observes and not hook.observes:
        return AttentionDispatch(earlier.key, layer, dispatch_over(earlier.previous, hook, layer), observes=True)
    return AttentionDispatch(hook.key, layer, earlier, hook.observes)


def ours(patch: Any, key: str) -> bool:
    """Whether `patch` is one this pack registered under `key` (an earlier node of the same kind)."""
    return isinstance(patch, (BlockReplacement, AttentionDispatch)) and patch.key == key


def block_hooks(diffusion_model: Any, hook: BlockHook, previous_replacements: dict, object_patches: dict,
                swap: bool = True) -> tuple[dict[int, BlockReplacement], dict[str, AttentionDispatch]]:
    """Replacements per block index and the attn.forward object patches (older upstream only).

    `previous_replacements` maps block index -> an earlier ("dit", "double_block", i) patch to
    chain; `object_patches` are the ModelPatcher's current object patches. A patch of an earlier
    node of the same kind is not chained but replaced (what it chained is chained instead).
    `swap=False`: mark the calls only (`BlockReplacement`), never swap their attention.
    """
    replacements, patches = {}, {}
    for i, block in enumerate(diffusion_model.blocks):
        previous = previous_replacements.get(i)
        if ours(previous, hook.key):
            previous = previous.previous
        forward = object_patches.get(f"diffusion_model.blocks.{i}.forward", type(block).forward)
        via_args = takes_attention_arg(forward) if swap else None
        replacements[i] = BlockReplacement(hook.key, i, via_args, previous)
        if via_args is False:
            key = f"diffusion_model.blocks.{i}.attn.forward"
            patches[key] = dispatch_over(object_patches.get(key), hook, i)
    return replacements, patches


def install(model_patcher: Any, hook: BlockHook, swap: bool = True) -> Any:
    """A clone of `model_patcher` whose H3 blocks run `hook` (plus its wrapper and callbacks).

    The node nearer the sampler decides: an earlier hook of the same kind on this model is
    replaced (its patches, wrapper and callbacks removed; its report then shows this one's runs).
    """
    import comfy.patcher_extension as pe

    diffusion_model = model_patcher.get_model_object("diffusion_model")
    check_h3(diffusion_model)
    hook.check_core_sparse(model_patcher.model_options, "before")
    m = model_patcher.clone()
    earlier = m.get_attachment(hook.key)
    if earlier is not None:
        hook.start_state(earlier)
        hook.replaced(earlier)
        m.remove_wrappers_with_key(pe.WrappersMP.DIFFUSION_MODEL, hook.key)
        for call_type in (pe.CallbacksMP.ON_PRE_RUN, pe.CallbacksMP.ON_CLEANUP):
            m.remove_callbacks_with_key(call_type, hook.key)
    replacements, patches = block_hooks(diffusion_model, hook, double_block_patches(m.model_options),
                                        m.object_patches, swap)
    for i, fn in replacements.items():
        m.set_model_patch_replace(fn, "dit", "double_block", i)
    for key, fn in patches.items():
        m.add_object_patch(key, fn)
    m.set_attachments(hook.key, hook)
    bind(diffusion_model, hook)  # until the sampler binds the patcher it samples
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, hook.key, DiffusionModelWrapper(hook.key))
    m.add_callback_with_key(pe.CallbacksMP.ON_PRE_RUN, hook.key, PreRun(hook.key))
    m.add_callback_with_key(pe.CallbacksMP.ON_CLEANUP, hook.key, Cleanup(hook.key))
    return m


def hooks_of(model_patcher: Any) -> list[BlockHook]:
    """The hooks this pack installed on `model_patcher` (its attachments)."""
    attachments = getattr(model_patcher, "attachments", {})
    return [h for h in attachments.values() if isinstance(h, BlockHook)]
