"""The hook framework: a `BlockHook` takes over the attention of chosen MiniMax-H3 block calls.

A hook object is the state of one patched model: its run tracker, layout cache and settings. It is
a ModelPatcher attachment, so every clone ComfyUI makes (``clone()``, ``deepclone_multigpu``)
gets its own (`BlockHook.on_model_patcher_clone`), and it is bound to the diffusion model that
patcher samples when sampling starts (`bind`). What is registered in ``model_options`` (block
patches, wrapper, callbacks; `nodes/model_patches.py`) holds only the hook's key, a layer index
and the patch it chains: every call finds its hook and its attention modules from the diffusion
model it runs on, never from the model the node patched.

Under torch.compile (ComfyUI's TorchCompileModel compiles the whole diffusion model and drops
every guard under ``transformer_options``, so a decision read from there in compiled code would be
frozen at its first value) the pack's own frames run eagerly: the wrapper's `begin_call`, each
block replacement's decision and the attention it hands the block (`nodes/model_patches.py`).
Everything they call of ComfyUI's (the block's norms, MLP and projections, ComfyUI's own attention in
dense blocks) is compiled as it is without this pack; the sparse attention itself stays eager.
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..backend.layout import SequenceLayout
from ..notices import logger
from .core_sparse import refuse_core_sparse
from .h3_model import payload_layout
from .model_state import model_state
from .run_tracker import RunTracker

log = logger()

STATE_ATTR = "adaptive_sparse_attention_hooks"  # on a diffusion model: hook key -> the hook sampling it


@dataclass
class CallContext:
    """What one model call shares with all its blocks.

    Attributes:
        hook: the state of the model this call runs on.
        model: the diffusion model this call runs on (its blocks' attention modules are used).
        step: the denoising step in the run (None when ComfyUI passed no sigmas).
        sigma: the call's sigma (None likewise).
        segment: (step, total) within this sampler call's own schedule, or None.
        packed: the PackedLayout found by the DIFFUSION_MODEL wrapper, if any.
        next_sigma: the run's schedule's sigma after this call's (`RunTracker.next_sigma`), or None.
    """

    hook: BlockHook
    model: Any
    step: int | None = None
    sigma: float | None = None
    segment: tuple[int, int] | None = None
    packed: Any = None
    next_sigma: float | None = None

    def attn(self, layer: int) -> torch.nn.Module:
        """The attention module of block `layer` of the model this call runs on."""
        return self.model.blocks[layer].attn


@dataclass(frozen=True)
class Mark:
    """What a block replacement leaves in its copy of ``transformer_options`` for the block's attention:
    the block index, the hook's token (None: not taken), the block's attention module and the call."""

    layer: int
    token: Any
    attn: torch.nn.Module
    ctx: CallContext


def bind(diffusion_model: Any, hook: BlockHook) -> None:
    """Make `hook` the state that calls of `diffusion_model` use for hooks of its key."""
    hooks = diffusion_model.__dict__.get(STATE_ATTR)
    if hooks is None:
        hooks = {}
        diffusion_model.__dict__[STATE_ATTR] = hooks
    hooks[hook.key] = hook


def bound_hook(diffusion_model: Any, key: str) -> BlockHook:
    """The hook `bind` gave `diffusion_model` for `key` (RuntimeError when none was bound)."""
    hook = diffusion_model.__dict__.get(STATE_ATTR, {}).get(key)
    if hook is None:
        raise RuntimeError(f"{key}: this diffusion model runs the pack's block patches, but no sampling state was "
                           "bound to it (ComfyUI binds it when sampling starts, in the model's ON_PRE_RUN callbacks)")
    return hook


class BlockHook(ABC):
    """Base of a hook that takes over the attention of chosen H3 block calls, and the state of one
    patched model.

    Subclasses implement `decide` (which calls, returning a token or None) and `attend` (the
    attention output [S, hidden] of a taken call, out_proj included). The base keeps the per-run
    state: step counting, layout discovery and the run tracker.
    """

    kind = "hook"
    # An observer only looks at the calls it takes (its `attend` returns `fallback`'s output for the same
    # input): its attention runs outermost and passes the call on, so it sees the calls another hook takes,
    # whichever node is nearer the sampler (`nodes/model_patches.py`).
    observes = False

    def __init__(self) -> None:
        self.start_state(None)

    @property
    def key(self) -> str:
        """The key of this kind of hook in model_options, transformer_options and attachments."""
        return f"adaptive_sparse_attention.{self.kind}"

    @property
    def title(self) -> str:
        """The hook's name in log messages and errors."""
        return type(self).__name__

    def start_state(self, parent: BlockHook | None) -> None:
        """Fresh per-model state; the run reports also go to `parent`'s tracker (the model this one
        was cloned from, or the hook of an earlier node this one replaced)."""
        self.parent = parent
        self.tracker = RunTracker(self.title, parent=None if parent is None else parent.tracker)

    def on_model_patcher_clone(self) -> BlockHook:
        """ComfyUI's ModelPatcher.clone(): the clone runs with its own state and the same settings."""
        twin = copy.copy(self)
        twin.start_state(self)
        return twin

    def __deepcopy__(self, memo: dict) -> BlockHook:
        """A deep copy of a model this hook is bound to (`bind`) runs with its own state, as a clone does."""
        return self.on_model_patcher_clone()

    # --- per-call plumbing -------------------------------------------------------------------
    @torch.compiler.disable
    def begin_call(self, model: Any, x: Any, context: torch.Tensor, transformer_options: dict,
                   payload: dict) -> CallContext:
        """The `CallContext` of a model call on `model`: its step (from the sigmas, on the host) and
        the packed layout. Always eager (one graph break per model call under torch.compile; H3's
        forward reads its sigma on the host there too)."""
        step, sigma, segment = self.tracker.step_of(transformer_options)
        ctx = CallContext(self, model, step, sigma, segment, next_sigma=self.tracker.next_sigma(sigma))
        try:
            ctx.packed = payload_layout(model, x, context, payload)
        except Exception as err:  # layout discovery must never break sampling; blocks report it
            self.tracker.log_once(f"could not rebuild the packed layout from minimax_payload ({err})")
        return ctx

    def layout(self, args: dict, ctx: CallContext) -> SequenceLayout | None:
        """The call's layout: from the block args, transformer_options or the wrapper, else None (one object
        per shape of the model the call runs on: `model_state.ModelState`)."""
        to = args.get("transformer_options", {})
        for packed in (args.get("layout"), to.get("minimax_h3_layout"), ctx.packed):
            if packed is not None:
                return model_state(ctx.model).layouts.of(packed)
        return None

    def dense_args(self, args: dict, attn: torch.nn.Module) -> dict:
        """The block args of a call of block attention `attn` this hook does not take (unchanged here)."""
        return args

    def on_pre_run(self, patcher: Any) -> None:
        """Start of a sampler call on `patcher`: ComfyUI's core sparse node applied after this one is
        checked (the run itself goes on across sampler calls; see `RunTracker.step_of`)."""
        self.check_core_sparse(patcher.model_options, "after")

    @property
    def leaves_attention(self) -> bool:
        """Whether this sampler call leaves every block's attention to ComfyUI (or another node)."""
        return False

    def check_core_sparse(self, model_options: dict, order: str) -> None:
        """ComfyUI's core sparse node on the model, applied `order` this hook's node: refused here
        (`SparseAttentionHook` leaves the attention to it unless strict)."""
        refuse_core_sparse(model_options, self.title, order)

    def on_cleanup(self, patcher: Any) -> None:
        """End of a sampler call: the report of the run so far is kept (`RunTracker.end_call`)."""
        self.tracker.end_call()

    def replaced(self, earlier: BlockHook) -> None:
        """This hook replaces `earlier`, the hook of a node of the same kind farther from the sampler."""
        log.warning("%s: a second node of this kind patches the same model; the one nearer the sampler decides "
                    "for the whole model (the earlier node's settings are not used)", self.title)

    # --- subclass contract -------------------------------------------------------------------
    @abstractmethod
    def decide(self, layer: int, attn: torch.nn.Module, args: dict, ctx: CallContext) -> Any:
        """A token when this hook takes the call's attention (passed on to `attend`), else None."""

    @abstractmethod
    def attend(self, layer: int, token: Any, attn: torch.nn.Module, x: Any, rope_freqs: Any,
               transformer_options: dict, fallback: Callable) -> torch.Tensor:
        """The attention output [S, hidden] (out_proj applied) of block input x; `fallback` is the
        attention that would have run (same call signature as ``attn``)."""
