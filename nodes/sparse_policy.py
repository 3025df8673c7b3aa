"""The sparse-attention policy: which H3 block calls run adaptive sparse attention (`SparseAttentionHook`),
and the node's patch of a model (`apply_sparse_attention`). The jobs around the per-call decision live in
their own modules: the step schedule (`schedule`), other patches on the model (`interop`), size notices
(`size_notice`), kernel preparation (`preparation`), the sparse call itself (`sparse_call`)."""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..backend.config import SparseConfig
from ..backend.layout import SequenceLayout
from ..errors import SparseAttentionError
from ..kernels.dense.choice import DenseChoices
from ..kernels.sparse_choice.choice import SparseChoices
from ..kernels.sparse_choice.choice import default_cache_path as sparse_cache_path
from . import interop, plan_estimate, sparse_call
from .block_hook import BlockHook, CallContext, log
from .core_sparse import core_sparse_blocks, core_sparse_message, fasth3_message, gated_blocks, refuse_core_sparse
from .dense_override import DenseOverride, is_ours
from .model_patches import install
from .model_state import comfy_user_dir, model_state
from .model_state import dense_choices as comfy_dense_choices
from .precision import launch_attention, model_choice, module_attention, resolve_precision
from .preparation import prepare_layout
from .reference_notice import REASON as NO_FAST_KERNEL
from .reference_notice import dense_notice, no_fast_kernel, strict_refusal
from .schedule import ramp_ratio, schedule_reason, start_sigma, warmup_reason, warmup_sigma
from .size_notice import SizeNotice


class SparseAttentionHook(BlockHook):
    """Adaptive sparse attention in the blocks and steps the schedule allows."""

    kind = "sparse"

    def __init__(self, config: SparseConfig, dense_choices: DenseChoices | None = None,
                 sparse_choices: SparseChoices | None = None):
        self.config = config
        self.dense_choices = dense_choices if dense_choices is not None else comfy_dense_choices()
        self.sparse_choices = (sparse_choices if sparse_choices is not None else  # `kernel="auto"`'s measured choice
                               SparseChoices(sparse_cache_path(comfy_user_dir())))
        self.notices: list[str] = []  # what the user should know about this model and config (report node)
        self.sizes = SizeNotice()  # shared with the clones
        super().__init__()

    def start_state(self, parent: BlockHook | None) -> None:
        """Fresh per-model state (see `BlockHook.start_state`), with its own dense override, warmup
        sigma and precision (both set from the sampled model when sampling starts)."""
        super().start_state(parent)
        self.notices = list(self.notices)
        self.dense_override = DenseOverride(self.dense_choices, self.tracker.note_dense_kernel)
        self.warmup_sigma: float | None = None
        self.start_sigma: float | None = None
        self.left_to: str | None = None  # why this sampler call leaves every block's attention to ComfyUI
        self.launched = launch_attention(None)  # ComfyUI's attention for the blocks (set from the sampled model)
        self.set_precision(*resolve_precision(self.config.precision, self.launched, None))

    def set_precision(self, precision: str, reason: str) -> None:
        """Run at `precision` ("bf16" or "8-bit"): the engine's config, the dense override's bound, the report.
        The engine's config has no error target: the policy holds it and sets each call's ratio (a ramped step's
        too, outside the target's range)."""
        self.engine_config = self.config.replace(precision=precision, error_target=0.0)
        self.dense_override.precision = precision
        self.tracker.precision = (precision, reason)

    def on_pre_run(self, patcher: Any) -> None:
        """Start of a sampler call: the warmup sigmas of the sampled model's schedule, the precision (`auto`
        follows the attention ComfyUI runs for this model) and whether the call leaves attention to ComfyUI."""
        super().on_pre_run(patcher)
        sampling = patcher.get_model_object("model_sampling")
        self.warmup_sigma = None if sampling is None else warmup_sigma(self.config, sampling.percent_to_sigma)
        self.start_sigma = None if sampling is None else start_sigma(sampling)
        override = patcher.model_options.get("transformer_options", {}).get("optimized_attention_override")
        override = None if is_ours(override) else override
        self.dense_override.chosen = model_choice(override)  # ModelAttentionBackend's, followed as a launch's
        diffusion_model = patcher.get_model_object("diffusion_model")
        modules = [module_attention(block.attn) for block in getattr(diffusion_model, "blocks", ())]
        self.launched = launch_attention(diffusion_model)
        self.set_precision(*resolve_precision(self.config.precision, self.launched, override, modules))
        self.left_to = interop.leave_reason(patcher, self.config, self.title, self.notices, self.announce, self.tracker)

    @property
    def leaves_attention(self) -> bool:
        """Whether this sampler call leaves every block's attention to ComfyUI (`interop.leave_reason`)."""
        return self.left_to is not None

    def check_core_sparse(self, model_options: dict, order: str) -> None:
        """ComfyUI's core sparse node on the model: strict refuses it; otherwise the attention is left to it."""
        if self.config.strict:
            refuse_core_sparse(model_options, self.title, order)
        elif order == "before" and core_sparse_blocks(model_options):
            self.announce(core_sparse_message(self.title, order, len(core_sparse_blocks(model_options))))

    def announce(self, message: str) -> None:
        """Say `message` at WARNING and keep it for the report, here and in the hooks this one was cloned
        from (the model the report node reads), unless this model said it already."""
        if message in self.notices:
            return
        log.warning("%s", message)
        hook = self
        while hook is not None:
            if message not in hook.notices:
                hook.notices.append(message)
            hook = hook.parent

    def replaced(self, earlier: BlockHook) -> None:
        """Say in the log and in the report that this node's settings replace an earlier node's."""
        super().replaced(earlier)
        self.notices.append("a second Adaptive Sparse Attention node patched this model: the one nearer the "
                            "sampler decides for the whole model; this report shows what it ran")

    def warmup(self, ctx: CallContext) -> str | None:
        """Why the call's step is a warmup step that runs dense, or None (`schedule.warmup_reason`)."""
        return warmup_reason(self.config, ctx.sigma, self.warmup_sigma, ctx.segment, self.start_sigma)

    @property
    def title(self) -> str:
        """The hook's name in log messages and errors."""
        return "adaptive sparse attention"

    def refuse(self, layer: int, problem: str) -> None:
        """A call that cannot run sparse: strict raises, otherwise the reason is logged once per run."""
        self.tracker.notices.fallback(f"{self.title}: layer {layer} runs dense: {problem}", None, self.config.strict)

    def choose(self, layer: int, attn: torch.nn.Module, x: torch.Tensor, layout: SequenceLayout | None,
               warmup: str | None, head_chunks: Any) -> str | None:
        """Why this block call runs dense, or None when it runs sparse. The first call that needs them (a
        warmup step of a sparse layer, or the first sparse step) prepares the layout's kernels; an unsupported call
        raises under `strict`, else its reason is logged once per run (`slow_kernel`: said once per run)."""
        rows, dtype, device = x.shape[0], x.dtype, x.device
        reason = schedule_reason(self.config, layer, warmup, rows)
        problem = sparse_call.call_problem(attn, tuple(x.shape), dtype, device, layout)
        sparse_layer = schedule_reason(self.config, layer, None, rows) is None
        if problem is None and layer not in self.config.dense_layers and self.config.warmup_mode != "dense":
            self.sizes.note(rows, dtype, device, self.config, self.dense_choices, self.tracker)
        slow = None if problem is not None or not sparse_layer else self.slow_kernel(layout, dtype, device, attn.head_dim)
        if problem is None and sparse_layer and slow is None:
            prepare_layout(self.engine_config, attn, dtype, device, layout, head_chunks)
        if reason is not None:
            return reason
        if problem is not None:
            self.refuse(layer, problem)
            return problem
        return None if slow is None else self.dense_instead(slow)

    def slow_kernel(self, layout: SequenceLayout, dtype: torch.dtype, device: torch.device, head_dim: int) -> str | None:
        """Why this layout's sparse calls would run the torch reference (`no_fast_kernel`, resolved once per layout
        and call kind), or None."""
        config = self.engine_config
        key = (config.kernel, config.block_size, config.exact_precision, str(device), dtype, head_dim)
        return layout.cache.get("no_fast_kernel", key,
                                lambda: no_fast_kernel(config, device, dtype, head_dim))

    def dense_instead(self, why: str) -> str:
        """A sparse call that runs dense because no fast sparse kernel runs (`why`): strict raises; otherwise
        said once per run and kept in the report. Returns the report's reason."""
        if self.config.strict:
            raise SparseAttentionError(strict_refusal(self.title, why))
        self.tracker.say_in_report(dense_notice(why))
        return NO_FAST_KERNEL

    def decide(self, layer: int, attn: torch.nn.Module, args: dict, ctx: CallContext) -> Any:
        """(step, layout, engine config of the step, cond/uncond branch, (sigma, next sigma)) when this call
        runs sparse, else None (the call is counted dense with its reason)."""
        reason = self.left_to
        to = args.get("transformer_options", {})
        branch = tuple(to.get("cond_or_uncond") or ())
        self.tracker.note_branch(branch, ctx.step)
        if reason is None:
            self.tracker.log_once("precision {} ({})".format(*self.tracker.precision), logging.INFO)
            layout = self.layout(args, ctx)
            reason = self.choose(layer, attn, args["img"], layout, self.warmup(ctx), to.get("minimax_head_chunks", 1))
            if reason is None:
                interop.note_other_override(to, self.tracker)
                ratio = ramp_ratio(self.config, ctx.sigma, self.warmup_sigma, self.start_sigma, ctx.segment)
                if self.config.error_target > 0 and ratio == self.config.topk_ratio:  # not on a ramped step
                    stats = self.tracker.stats
                    ratio = stats.target.ratio(stats.errors, layer, ctx.step, self.config.error_target, ratio)
                config = self.engine_config if ratio == self.engine_config.topk_ratio else \
                    self.engine_config.replace(topk_ratio=ratio)
                plans = self.tracker.plans
                if config.plan_reuse == "auto" and not plans.expects(layout.signature()):
                    plans.expect(layout.signature(), plan_estimate.estimate(
                        ctx.model, self.config, attn.heads, to.get("minimax_head_chunks", 1),
                        self.tracker.seen_branches(), ctx.step))
                return (ctx.step, layout, config, branch, (ctx.sigma, ctx.next_sigma))
        self.tracker.note_block(ctx.step, sparse=False, layer=layer, reason=reason)
        return None

    def dense_args(self, args: dict, attn: torch.nn.Module) -> dict:
        """Args of a dense call of block attention `attn`: on the fastest exact kernel, with the attention
        `attn` chose among the candidates, unless ComfyUI keeps this call (`interop.dense_args`)."""
        return args if self.left_to is not None else interop.dense_args(args, self.config, self.dense_override,
                                                                        self.tracker, module_attention(attn))

    def attend(self, layer: int, token: Any, attn: torch.nn.Module, x: Any, rope_freqs: Any,
               transformer_options: dict, fallback: Callable) -> torch.Tensor:
        """Sparse attention of block input x, then out_proj (`sparse_call.attend`). Eager inside a compiled
        model too (its caller, `HookedAttention`, is skipped by torch.compile)."""
        return sparse_call.attend(self.tracker, self.sparse_choices, self.config, layer, token, attn, x, rope_freqs,
                                  transformer_options, self.dense_baseline)

    def dense_baseline(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Callable, str]:
        """The dense attention a dense block of this model would run on q, k, v (`DenseOverride.baseline`)."""
        return self.dense_override.baseline(q, k, v, self.launched, self.config.dense_attention == "fastest")


def apply_sparse_attention(model_patcher: Any, config: SparseConfig) -> Any:
    """A clone of an H3 ModelPatcher whose blocks run adaptive sparse attention under `config`, with the
    loaded model's shared layouts and kernel choices (`model_state`)."""
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    state = model_state(diffusion_model)
    hook = SparseAttentionHook(config, state.dense_choices, state.sparse_choices)
    gated = gated_blocks(diffusion_model)
    if gated and config.tail != "coarse":
        message = fasth3_message(hook.title, gated, len(diffusion_model.blocks))
        if config.strict:
            raise SparseAttentionError(f"{message}. strict=True refuses to run this node on it")
        hook.announce(message)
    elif gated:
        hook.announce(f"{hook.title}: tail='coarse' on a distilled FastH3 checkpoint runs this node's tiling "
                      f"({config.tiling}) with the checkpoint's coarse gate; the weights were trained for VSA's "
                      "pattern (4x4x4-token cubes, 10% kept), which ComfyUI's core 'Model Sparse Attention' node "
                      "runs with method vsa")
    patched = install(model_patcher, hook)
    notice = sparse_call.gate_notice(diffusion_model, config)
    if notice is not None:
        log.warning("%s: %s", hook.title, notice)
        hook.notices.append(notice)
    return patched
