"""Hooks into ComfyUI's MiniMax-H3 DiT blocks, and the sparse-attention hook built on them.

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
import sys
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..backend.attention import DTYPES, HEAD_DIMS, sparse_attention
from ..backend.cache import BoundedCache
from ..backend.config import SparseConfig
from ..backend.layout import SequenceLayout
from ..backend.producer import produce_qkv
from ..backend.warmup import prepare_kernels
from ..kernels.dense import DenseChoices
from ..kernels.dispatch import resolve_backend, runs_triton
from .schedule import RunTracker, schedule_reason

log = logging.getLogger("adaptive_sparse_attention")

LAYOUT_CACHE_SIZE = 8
DEVICES = ("cuda", "cpu")
_ids = itertools.count()
# Hook key -> the block tokens of the model call now running under torch.compile. ComfyUI's
# TorchCompileModel drops every guard whose source passes through transformer_options (the block
# patches, the hooks and their state included), so a decision read there would be baked into the
# compiled graph; this module global keeps its guards: a changed decision recompiles.
COMPILED_CALLS: dict[str, tuple] = {}


def check_h3(diffusion_model: Any) -> None:
    """Raise ValueError unless `diffusion_model` is ComfyUI's MiniMax-H3 DiT."""
    cls = type(diffusion_model)
    blocks = getattr(diffusion_model, "blocks", None)
    shaped = bool(blocks) and all(
        all(hasattr(getattr(b, "attn", None), a) for a in ("qkv_proj", "q_norm", "k_norm", "out_proj", "heads", "head_dim"))
        for b in blocks)
    if cls.__name__ != "MiniMaxH3Model" or not shaped:
        raise ValueError(
            f"Adaptive Sparse Attention (MiniMax-H3) only patches ComfyUI's MiniMax-H3 model "
            f"(comfy.ldm.minimax.model.MiniMaxH3Model), but this MODEL's diffusion model is "
            f"{cls.__module__}.{cls.__name__}. Load a MiniMax-H3 checkpoint (UNETLoader) and connect it here.")


class LayoutCache(BoundedCache[SequenceLayout]):
    """ComfyUI ``PackedLayout`` -> `SequenceLayout`, cached per (signature, segments), bounded."""

    def __init__(self, size: int = LAYOUT_CACHE_SIZE):
        super().__init__(size)

    def of(self, packed: Any) -> SequenceLayout:
        """The layout of a ComfyUI ``PackedLayout``, converted once per signature."""
        key = (getattr(packed, "signature", None), tuple(tuple(s) for s in packed.segments))
        return self.get(key, lambda: SequenceLayout.from_packed(packed))


@dataclass(frozen=True)
class Planned:
    """The token of a block call planned by `SparseAttentionHook.plan_call`: it runs sparse on `layout`."""

    layout: SequenceLayout


@dataclass
class CallContext:
    """What one model call shares with all its blocks."""

    step: int | None
    total: int | None
    packed: Any = None  # the PackedLayout found by the DIFFUSION_MODEL wrapper, if any


def payload_layout(model: Any, x: Any, context: torch.Tensor, payload: dict) -> Any:
    """The PackedLayout this call runs with: the payload's when its signature matches, else a new one.

    Mirrors H3's own choice (older upstream passes no layout to the blocks).
    """
    video, audio = x[0], x[1]
    pt, ph, pw = getattr(model, "patch_size", (1, 2, 2))
    signature = (context.shape[1], -(-video.shape[2] // pt) * pt, -(-video.shape[3] // ph) * ph,
                 -(-video.shape[4] // pw) * pw, audio.shape[-1])
    layout = payload.get("layout")
    if layout is not None and getattr(layout, "signature", None) == signature:
        return layout
    packed_cls = getattr(sys.modules.get(type(model).__module__), "PackedLayout", None)
    if packed_cls is None:
        return None
    return packed_cls(*signature, keyframes=payload.get("keyframes"), refs=payload.get("refs"))


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


# ComfyUI's own "Model Sparse Attention" node (BlockSparseAttention) registers its block patches
# from this module with set_model_patch_replace. Older versions replace whatever was there and
# never call it; newer ones chain it and mark their patches with a `_block_sparse_attention_patch`
# attribute, but still swap the attention of the calls they take and put their own attention
# override on the rest.
CORE_SPARSE_MODULE = "comfy_extras.nodes_sparse_attention"
CORE_SPARSE_MARK = "_block_sparse_attention_patch"
CORE_SPARSE_NODE = "ComfyUI's 'Model Sparse Attention' node (BlockSparseAttention)"


def double_block_patches(model_options: dict) -> dict[int, Callable]:
    """Block index -> the ("dit", "double_block", i) replacement registered in `model_options`."""
    dit = model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    return {key[1]: fn for key, fn in dit.items() if len(key) == 2 and key[0] == "double_block"}


def core_sparse_blocks(model_options: dict) -> list[int]:
    """Blocks whose replacement comes from ComfyUI's core sparse node."""
    return sorted(i for i, fn in double_block_patches(model_options).items()
                  if getattr(fn, "__module__", None) == CORE_SPARSE_MODULE or hasattr(fn, CORE_SPARSE_MARK))


def refuse_core_sparse(model_options: dict, title: str, order: str) -> None:
    """Raise when ComfyUI's core sparse node patched the blocks too (in `order` to this node).

    Both replace the attention of the same blocks, and the core node either drops earlier block
    patches (older ComfyUI) or overrides the attention of every call it does not take itself (newer),
    so composing them would silently run something else than either node says; the user is told
    to keep one of them.
    """
    blocks = core_sparse_blocks(model_options)
    if blocks:
        raise ValueError(
            f"{title}: {CORE_SPARSE_NODE} is applied {order} this node on the same model ({len(blocks)} H3 blocks). "
            "Both replace the attention of the same blocks, so one of them would silently not run as set. "
            "Keep one of the two nodes (remove or bypass the other).")


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


# --- weights through ComfyUI's casting (LoRA, offload, quantised weights) ----------------------
@contextmanager
def linear_weights(module: torch.nn.Module, like: torch.Tensor) -> Iterator[tuple[torch.Tensor, Any]]:
    """(weight, bias) of a Linear in `like`'s dtype and device.

    ComfyUI layers go through `comfy.ops.cast_bias_weight`, which dequantises, applies LoRA
    weight functions and handles offloaded weights; plain torch layers are cast directly.
    """
    if not hasattr(module, "comfy_cast_weights"):
        bias = None if module.bias is None else module.bias.to(like)
        yield module.weight.to(like), bias
        return
    import comfy.ops

    if not hasattr(comfy.ops, "CastBiasWeightContext"):  # older ComfyUI: no offload-aware context yet
        yield comfy.ops.cast_bias_weight(module, like)
        return
    with comfy.ops.CastBiasWeightContext(module, like, offloadable=True) as (weight, bias):
        yield weight, bias


def outside_allocation_graph() -> Any:
    """A context that keeps our allocations out of ComfyUI's allocation graph, where it has one.

    Current ComfyUI records the allocations of an H3 forward on CUDA and replays them
    (``comfy.model_prefetch.pause_malloc_graph``, its "model compiler"); its own sparse node pauses
    that for what outlives a call. The engine keeps tiling, routing and reblock tensors across
    calls, so the whole sparse path and the kernel preparation run paused. Older ComfyUI has no
    such graph, and under torch.compile there is nothing to pause at trace time.
    """
    pause = getattr(sys.modules.get("comfy.model_prefetch"), "pause_malloc_graph", None)
    if pause is None or torch.compiler.is_compiling():
        return nullcontext()
    return pause()


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small parameter (norm weight) on `device`, through ComfyUI's cast when it is loaded."""
    mm = sys.modules.get("comfy.model_management")
    return mm.cast_to(t, device=device) if mm is not None else t.to(device)


def head_groups(heads: int, chunks: Any) -> list[tuple[int, int]]:
    """Split heads into `chunks` near-equal groups (KJNodes' ``minimax_head_chunks``)."""
    n = max(1, min(int(chunks) if isinstance(chunks, int) else 1, heads))
    sizes = [heads // n + (1 if i < heads % n else 0) for i in range(n)]
    bounds = list(itertools.accumulate([0] + sizes))
    return list(zip(bounds[:-1], bounds[1:]))


class DenseOverride:
    """``optimized_attention_override`` of the blocks our node runs dense: the fastest exact kernel.

    ComfyUI calls it with its own attention function and arguments; a call it does not serve (a
    mask, another attention precision) goes on to that function unchanged.

    Args:
        choices: the kernel choices it runs on; None: its own, saved at the default path.
    """

    def __init__(self, choices: DenseChoices | None = None):
        self.choices = DenseChoices() if choices is None else choices

    def __call__(self, func: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                 mask: Any = None, attn_precision: Any = None, skip_reshape: bool = False,
                 skip_output_reshape: bool = False, **kwargs: Any) -> torch.Tensor:
        if mask is not None or attn_precision is not None or kwargs.get("enable_gqa") or q.dtype not in DTYPES:
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)
        if not skip_reshape:  # [B, S, H * D] -> [B, H, S, D]
            q, k, v = (t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
        out = self.choices.attention(q, k, v)
        if skip_output_reshape:
            return out
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


DENSE_OVERRIDE = DenseOverride()


def unwrap_input(x: Any) -> torch.Tensor:
    """KJNodes' low-VRAM block forward hands the attention input in a one-item list to free it early."""
    return x.pop() if isinstance(x, list) else x


class SparseAttentionHook(BlockHook):
    """Adaptive sparse attention in the blocks and steps the schedule allows."""

    name = "sparse"

    def __init__(self, config: SparseConfig):
        self.config = config
        self.notices: list[str] = []  # what the user should know about this model and config (report node)
        super().__init__()

    @property
    def title(self) -> str:
        """The hook's name in log messages and errors."""
        return "adaptive sparse attention"

    def unsupported(self, attn: torch.nn.Module, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                    layout: SequenceLayout | None) -> str | None:
        """Why a block call with input of this shape (rows, hidden), dtype and device cannot run sparse, or None."""
        if layout is None:
            return ("the packed-sequence layout was not found (no args['layout'], "
                    "transformer_options['minimax_h3_layout'] or minimax_payload layout)")
        if len(shape) != 2 or shape[0] != layout.total:
            return f"block input of shape {tuple(shape)} does not match the layout's {layout.total} rows"
        if attn.head_dim not in HEAD_DIMS:
            return f"head_dim={attn.head_dim} is not supported (expected one of {HEAD_DIMS})"
        if dtype not in DTYPES:
            return f"dtype {dtype} is not supported (expected one of {', '.join(str(d) for d in DTYPES)})"
        if device.type not in DEVICES:
            return f"device {device} is not supported (expected one of {', '.join(DEVICES)})"
        return None

    def choose(self, layer: int, attn: torch.nn.Module, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device, layout: SequenceLayout | None, step: int | None, total: int | None) -> str | None:
        """Why this block call runs dense, or None when it runs sparse.

        Prepares the kernels of the calls that run sparse and of the warmup steps of sparse layers;
        an unsupported call raises under `strict`, else its reason is logged once per run.
        """
        reason = schedule_reason(self.config, layer, step, total, shape[0])
        problem = self.unsupported(attn, shape, dtype, device, layout)
        if reason is not None:
            if problem is None and schedule_reason(self.config, layer, None, None, shape[0]) is None:
                self.prepare(attn, dtype, device, layout)  # a warmup step of a sparse layer
            return reason
        if problem is not None:
            message = f"layer {layer} runs dense: {problem}"
            if self.config.strict:
                raise RuntimeError(f"{self.title} (strict): {message}")
            self.tracker.log_once(message)
            return problem
        self.prepare(attn, dtype, device, layout)  # strict raises here when Triton is asked for and missing
        return None

    def decide(self, layer: int, attn: torch.nn.Module, args: dict) -> Any:
        """(step, layout) when `choose` lets this call run sparse, else None (the call is counted
        dense with its reason)."""
        to = args.get("transformer_options", {})
        ctx = self.call_context(to)
        x = args["img"]
        layout = self.layout(args, ctx)
        reason = self.choose(layer, attn, tuple(x.shape), x.dtype, x.device, layout, ctx.step, ctx.total)
        if reason is None:
            self.note_other_override(to)
            return ctx.step, layout
        self.tracker.note_block(ctx.step, sparse=False, layer=layer, reason=reason)
        return None

    def plan_call(self, model: Any, ctx: CallContext, dtype: torch.dtype, device: torch.device,
                  transformer_options: dict) -> tuple:
        """Under torch.compile: `Planned` (sparse) or None (dense) for every block of this call.

        The blocks are counted here; the compiled sparse blocks are neither timed nor is their
        density measured, as both would synchronise the host in every block.
        """
        layout = None if ctx.packed is None else self.layouts.of(ctx.packed)
        rows = 0 if layout is None else layout.total
        tokens = []
        for layer, block in enumerate(model.blocks):
            attn = block.attn
            reason = self.choose(layer, attn, (rows, attn.qkv_proj.in_features), dtype, device, layout,
                                 ctx.step, ctx.total)
            tokens.append(None if reason is not None else Planned(layout))
            self.tracker.note_block(ctx.step, sparse=reason is None, density=None, layer=layer, reason=reason)
        if any(tokens):
            self.note_other_override(transformer_options)
            self.tracker.log_once("the model runs under torch.compile: sparse blocks are not timed and their "
                                  "density is not measured (each would synchronise the host in every block); "
                                  "compiled sparse steps measured slower than uncompiled ones, so for speed leave "
                                  "TorchCompileModel out of graphs with this node (BENCHMARKS.md, torch.compile)")
        return tuple(tokens)

    def note_other_override(self, transformer_options: dict) -> None:
        """Say once per run that another node's attention override does not reach the sparse blocks."""
        if transformer_options.get("optimized_attention_override") is not None:
            self.tracker.log_once("another node's optimized_attention_override applies to dense blocks "
                                  "only; sparse blocks run adaptive sparse attention")

    def prepare(self, attn: torch.nn.Module, dtype: torch.dtype, device: torch.device, layout: SequenceLayout) -> None:
        """Resolve the backend and, for Triton, compile its kernels for this layout before they run."""
        if runs_triton(resolve_backend(self.config.backend, device, dtype, self.config.strict, attn.head_dim,
                                       self.config.block_size)):
            with outside_allocation_graph():
                prepare_kernels(layout, self.config, dtype, device, attn.head_dim)

    def dense_args(self, args: dict) -> dict:
        """Args whose attention runs on the fastest exact kernel (``dense_attention="fastest"``),
        unless another node's override already decides the dense attention."""
        to = args.get("transformer_options", {})
        if self.config.dense_attention != "fastest" or to.get("optimized_attention_override") is DENSE_OVERRIDE:
            return args
        if to.get("optimized_attention_override") is not None:
            self.tracker.log_once("another node's optimized_attention_override runs the dense blocks "
                                  "(dense_attention='fastest' does not replace it)")
            return args
        return dict(args, transformer_options=dict(to, optimized_attention_override=DENSE_OVERRIDE))

    def attend(self, layer: int, token: Any, attn: torch.nn.Module, x: Any, rope_freqs: Any,
               transformer_options: dict, fallback: Callable) -> torch.Tensor:
        """Sparse attention of block input x, then out_proj (`output`). The first call of a layout in
        a run measures the density, the second is timed against dense attention for the report; a
        compiled call (a `Planned` token) was counted when its model call was planned."""
        if isinstance(token, Planned):  # a compiled call: counted in plan_call, nothing to measure
            return self.output(attn, x, rope_freqs, transformer_options,
                               lambda q, k, v, g: sparse_attention(q, k, v, token.layout, self.config, coarse_gate=g))
        step, layout = token
        timer = self.tracker.start_timer(x[0] if isinstance(x, list) else x)
        key = layout.signature()
        tracker = self.tracker

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
            if key not in tracker.densities:  # measured once per shape and run: it needs a host sync
                o, info = sparse_attention(q, k, v, layout, self.config, return_info=True, coarse_gate=g)
                tracker.densities[key] = info.density
            elif key not in tracker.timed:  # the next call (kernels compiled): vs dense
                o, sparse_ms, dense_ms = timed_against_dense(q, k, v, layout, self.config, g)
                tracker.note_timing(key, sparse_ms, dense_ms)
            else:
                o = sparse_attention(q, k, v, layout, self.config, coarse_gate=g)
            return o

        out = self.output(attn, x, rope_freqs, transformer_options, run)
        self.tracker.stop_timer(timer)
        self.tracker.note_block(step, sparse=True, density=tracker.densities[key], layer=layer)
        return out

    def output(self, attn: torch.nn.Module, x: Any, rope_freqs: Any, transformer_options: dict,
               run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
               ) -> torch.Tensor:
        """The attention output [S, hidden] of block input x (or KJNodes' one-item list, freed early):
        Q/K/V per head group (``minimax_head_chunks``), `run(q, k, v, gate)` -> [1, h, S, D] on each,
        then out_proj."""
        x = unwrap_input(x)
        heads, dim = attn.heads, attn.head_dim
        with outside_allocation_graph():
            out = x.new_empty(x.shape[0], heads, dim)
            gate = coarse_gate(attn, x, self.config)
            with linear_weights(attn.qkv_proj, x) as (weight, bias):
                qw, kw = on_device(attn.q_norm.weight, x.device), on_device(attn.k_norm.weight, x.device)
                for h0, h1 in head_groups(heads, transformer_options.get("minimax_head_chunks", 1)):
                    q, k, v = produce_qkv(x, weight, bias, heads, dim, qw, kw, attn.q_norm.eps, rope_freqs, (h0, h1))
                    g = None if gate is None else gate[:, h0:h1]
                    o = run(q, k, v, g)
                    out[:, h0:h1] = o[0].transpose(0, 1)
                    del q, k, v, o, g
            del x, gate
        return attn.out_proj(out.view(out.shape[0], heads * dim))


def hooks_of(model_patcher: Any) -> list[BlockHook]:
    """The hooks this pack installed on `model_patcher` (found through their DIFFUSION_MODEL wrappers)."""
    import comfy.patcher_extension as pe

    wrappers = getattr(model_patcher, "wrappers", {}).get(pe.WrappersMP.DIFFUSION_MODEL, {})
    return [fn.__self__ for fns in wrappers.values() for fn in fns if isinstance(getattr(fn, "__self__", None), BlockHook)]


def coarse_gate(attn: torch.nn.Module, x: torch.Tensor, config: SparseConfig) -> torch.Tensor | None:
    """The learned gate of the coarse branch for block input x, [1, H, S, D], or None.

    Blocks of distilled FastH3 (VSA) checkpoints carry ``attn.to_gate_compress``, a bias-free
    Linear(hidden, H * D) of the attention input; the attention output is then
    O_sparse + g * C with C the coarse branch (seed 000, 6.7). Only ``tail="coarse"`` uses it.
    """
    layer = getattr(attn, "to_gate_compress", None)
    if config.tail != "coarse" or layer is None:
        return None
    with linear_weights(layer, x) as (weight, bias):
        g = torch.nn.functional.linear(x, weight, bias)
    return g.view(x.shape[0], attn.heads, attn.head_dim).transpose(0, 1).unsqueeze(0)


def timed_against_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                        config: SparseConfig, gate: torch.Tensor | None) -> tuple[torch.Tensor, float, float]:
    """One sparse call timed against torch's dense SDPA on the same tensors (for the run report).

    Dense attention runs on the first head only and is scaled by the number of heads, to keep the
    extra cost to one head's attention. Synchronises the device three times.
    Returns (sparse output, sparse ms, dense ms for all heads of q).
    """
    def now() -> float:
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
        return time.perf_counter()

    t0 = now()
    out = sparse_attention(q, k, v, layout, config, coarse_gate=gate)
    t1 = now()
    torch.nn.functional.scaled_dot_product_attention(q[:, :1], k[:, :1], v[:, :1])
    t2 = now()
    return out, (t1 - t0) * 1e3, (t2 - t1) * 1e3 * q.shape[1]


def gate_notice(diffusion_model: Any, config: SparseConfig) -> str | None:
    """What tail="coarse" does on this model, when that is not the model's own gated coarse term."""
    if config.tail != "coarse":
        return None
    gated = sum(getattr(b.attn, "to_gate_compress", None) is not None for b in diffusion_model.blocks)
    if gated == 0:
        return ("tail='coarse': the model's blocks have no to_gate_compress gate (only distilled FastH3 checkpoints "
                "carry one), so the coarse term is zero and unselected blocks get no stand-in, as with tail='none'")
    if gated < len(diffusion_model.blocks):
        return (f"tail='coarse': {len(diffusion_model.blocks) - gated} of {len(diffusion_model.blocks)} blocks have "
                "no to_gate_compress gate; their coarse term is zero")
    if config.tail_granularity == "query":
        return ("tail='coarse' with tail_granularity='query' scores the coarse branch per query; the gate was trained "
                "with the block-broadcast term (tail_granularity='block')")
    return None


def apply_sparse_attention(model_patcher: Any, config: SparseConfig) -> Any:
    """A clone of an H3 ModelPatcher whose blocks run adaptive sparse attention under `config`."""
    hook = SparseAttentionHook(config)
    patched = install(model_patcher, hook)
    notice = gate_notice(model_patcher.get_model_object("diffusion_model"), config)
    if notice is not None:
        log.warning("%s: %s", hook.title, notice)
        hook.notices.append(notice)
    return patched
