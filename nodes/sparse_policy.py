"""The sparse-attention policy: which H3 block calls run adaptive sparse attention, and running them."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..backend.attention import DTYPES, HEAD_DIMS, sparse_attention
from ..backend.config import SparseConfig
from ..backend.layout import SequenceLayout
from ..backend.plan_reuse import PlanSlot
from ..backend.planner import layout_kernels
from ..backend.producer import produce_qkv
from ..backend.warmup import prepare_from_memory, prepare_kernels
from ..kernels.dense.choice import DenseChoices, default_cache_path
from ..kernels.dense.pays_from import describe, pays_at, saved
from ..kernels.registry import resolve_family
from ..kernels.sparse_choice.choice import SparseChoices
from ..kernels.sparse_choice.choice import default_cache_path as sparse_cache_path
from .comfy_weights import head_groups, on_device, outside_allocation_graph, qkv_projection, unwrap_input
from .model_patches import install
from .dense_override import DenseOverride
from .block_hook import BlockHook, CallContext, log
from .core_sparse import (core_sparse_blocks, core_sparse_message, core_sparse_order, fasth3_message, gated_blocks,
                          refuse_core_sparse)
from .precision import launch_attention, model_choice, resolve_precision
from .progress import progress_text
from .reference_notice import reference_kernel_notice
from .schedule import ramp_ratio, schedule_reason, start_sigma, warmup_reason, warmup_sigma
from .warm_start import WarmStart, standby_for, start_during_warmup, take_over_before_sparse

DEVICES = ("cuda", "cpu")


class SparseAttentionHook(BlockHook):
    """Adaptive sparse attention in the blocks and steps the schedule allows."""

    kind = "sparse"

    def __init__(self, config: SparseConfig, dense_choices: DenseChoices | None = None,
                 sparse_choices: SparseChoices | None = None, warm_start: WarmStart | None = None):
        self.config = config
        self.dense_choices = dense_choices if dense_choices is not None else DenseChoices(comfy_cache_path())
        self.sparse_choices = (sparse_choices if sparse_choices is not None else
                               SparseChoices(sparse_cache_path(comfy_user_dir())))  # `kernel="auto"`'s measured choice
        self.warm_start = warm_start if warm_start is not None else WarmStart()  # shared by the clones, as the choices
        self.notices: list[str] = []  # what the user should know about this model and config (report node)
        super().__init__()

    def start_state(self, parent: BlockHook | None) -> None:
        """Fresh per-model state (see `BlockHook.start_state`), with its own dense override, warmup
        sigma and precision (both set from the sampled model when sampling starts)."""
        super().start_state(parent)
        self.notices = list(self.notices)
        self.dense_override = DenseOverride(self.dense_choices, self.tracker.note_dense_kernel)
        self.warmup_sigma: float | None = None
        self.left_to: str | None = None  # why this sampler call leaves every block's attention to ComfyUI
        self.pays_from: dict[tuple, str | None] = {}  # (device, dtype) -> the measured crossover (`saved`)
        # size messages said at WARNING, shared with the clones of this model (later runs say them at INFO)
        self.said: set[str] = parent.said if isinstance(parent, SparseAttentionHook) else set()
        self.start_sigma: float | None = None
        self.set_precision(*resolve_precision(self.config.precision, launch_attention(None), None))

    def set_precision(self, precision: str, reason: str) -> None:
        """Run at `precision` ("bf16" or "8-bit", resolved from the node's setting): the engine's
        config (`engine_config`), the dense override's bound and the report."""
        self.engine_config = self.config.replace(precision=precision)
        self.dense_override.precision = precision
        self.tracker.precision = (precision, reason)

    def on_pre_run(self, patcher: Any) -> None:
        """Start of a sampler call: the warmup sigma of the sampled model's sampling (`warmup_sigma`)
        and the precision, which `auto` takes from the attention ComfyUI runs for this model (its
        launch's, ModelAttentionBackend's choice, or another node's override installed on it)."""
        super().on_pre_run(patcher)
        sampling = patcher.get_model_object("model_sampling")
        self.warmup_sigma = None if sampling is None else warmup_sigma(self.config, sampling.percent_to_sigma)
        self.start_sigma = None if sampling is None else start_sigma(sampling)
        override = patcher.model_options.get("transformer_options", {}).get("optimized_attention_override")
        if isinstance(override, DenseOverride):
            override = None
        self.dense_override.chosen = model_choice(override)  # ModelAttentionBackend's, followed as a launch's
        self.set_precision(*resolve_precision(self.config.precision,
                                              launch_attention(patcher.get_model_object("diffusion_model")),
                                              override))
        self.left_to = self.leave_reason(patcher)

    @property
    def leaves_attention(self) -> bool:
        """Whether this sampler call leaves every block's attention to ComfyUI (`leave_reason`)."""
        return self.left_to is not None

    def check_core_sparse(self, model_options: dict, order: str) -> None:
        """ComfyUI's core sparse node on the model: strict refuses it; otherwise this node leaves the
        attention to it (`leave_reason`), said once at WARNING and in the report."""
        if self.config.strict:
            refuse_core_sparse(model_options, self.title, order)
        elif order == "before":
            blocks = core_sparse_blocks(model_options)
            if blocks:
                self.announce(core_sparse_message(self.title, order, len(blocks)))

    def announce(self, message: str) -> None:
        """Say `message` at WARNING and keep it for the report, here and in the hooks this one was
        cloned from (the model the report node reads), unless this model said it already."""
        if message in self.notices:
            return
        log.warning("%s", message)
        hook = self
        while hook is not None:
            if message not in hook.notices:
                hook.notices.append(message)
            hook = hook.parent

    def leave_reason(self, patcher: Any) -> str | None:
        """Why this sampler call leaves every block's attention to ComfyUI, or None: ComfyUI's core
        sparse node is on the model (it runs the attention), or the checkpoint is a FastH3 one
        (trained for VSA's pattern; tail='coarse' runs ours with its gate). Logged once per run."""
        order = core_sparse_order(patcher.model_options)
        diffusion_model = patcher.get_model_object("diffusion_model")
        if order is not None:
            message = core_sparse_message(self.title, order, len(core_sparse_blocks(patcher.model_options)))
            reason = "left to ComfyUI's 'Model Sparse Attention' node, which runs these blocks"
        elif self.config.tail != "coarse" and gated_blocks(diffusion_model):
            message = fasth3_message(self.title, gated_blocks(diffusion_model), len(diffusion_model.blocks))
            reason = ("FastH3 checkpoint (to_gate_compress, trained for VSA's pattern): left to ComfyUI's attention; "
                      "ComfyUI's 'Model Sparse Attention' node with vsa runs its pattern")
        else:
            return None
        if message in self.notices:  # said at WARNING when the node was applied or in an earlier run
            self.tracker.log_once(message.removeprefix(f"{self.title}: "), logging.INFO)
        else:
            self.announce(message)
        return reason

    def replaced(self, earlier: BlockHook) -> None:
        """Say in the log and in the report that this node's settings replace an earlier node's."""
        super().replaced(earlier)
        self.notices.append("a second Adaptive Sparse Attention node patched this model: the one nearer the "
                            "sampler decides for the whole model; this report shows what it ran")

    def warmup(self, ctx: CallContext) -> str | None:
        """Why the call's step is a warmup step that runs dense, or None (`schedule.warmup_reason`)."""
        return warmup_reason(self.config, ctx.sigma, self.warmup_sigma, ctx.segment, self.start_sigma)

    def step_config(self, ctx: CallContext) -> SparseConfig:
        """The engine config of a sparse call: `engine_config` at the density `schedule.ramp_ratio` gives
        (another topk_ratio only on the ramped steps of `warmup_mode="ramp"`)."""
        ratio = ramp_ratio(self.config, ctx.sigma, self.warmup_sigma, self.start_sigma, ctx.segment)
        return self.engine_config if ratio == self.engine_config.topk_ratio else self.engine_config.replace(topk_ratio=ratio)

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
               device: torch.device, layout: SequenceLayout | None, warmup: str | None,
               head_chunks: Any) -> str | None:
        """Why this block call runs dense, or None when it runs sparse (`head_chunks`: KJNodes' head groups, one
        sparse call each).

        Prepares the kernels of the calls that run sparse and of the warmup steps of sparse layers;
        an unsupported call raises under `strict`, else its reason is logged once per run.
        """
        reason = schedule_reason(self.config, layer, warmup, shape[0])
        problem = self.unsupported(attn, shape, dtype, device, layout)
        if problem is None and layer not in self.config.dense_layers and self.config.warmup_mode != "dense":
            self.note_size(shape[0], dtype, device)
        if reason is not None:
            if problem is None and schedule_reason(self.config, layer, None, shape[0]) is None:
                self.prepare(attn, dtype, device, layout, head_chunks, warmup=True)  # a warmup step of a sparse layer
            return reason
        if problem is not None:
            self.refuse(layer, problem)
            return problem
        self.prepare(attn, dtype, device, layout, head_chunks)  # strict raises here when Triton is asked for and missing
        return None

    def note_size(self, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        """Say once per run, at WARNING and in the report, when `tokens` is too small for sparse attention
        to pay: below min_tokens (it runs dense), or below the crossover `prepare` measured on this GPU
        (it runs sparse, slower than dense); either with that crossover, or that it is not measured."""
        key = (str(device), dtype)
        if key not in self.pays_from:
            self.pays_from[key] = saved(self.dense_choices, device, dtype, self.config)
        value = self.pays_from[key]
        pays = pays_at(value, tokens)
        if tokens < self.config.min_tokens:
            hint = f"; lower min_tokens to {int(value):,} to run it sparse" if pays else ""
            message = (f"{tokens:,} tokens is below min_tokens={self.config.min_tokens:,}, so attention runs dense at "
                       f"this size; {describe(value)}{hint}")
        elif pays is False:
            raise_to = f" (raise min_tokens to {int(value):,} to run such sizes dense)" if value.isdigit() else ""
            message = f"{tokens:,} tokens is too small for sparse attention to pay; {describe(value)}{raise_to}"
        else:
            return
        if len(self.said) >= 64:  # bounded: a model sampled at many sizes says them at WARNING again
            self.said.clear()
        first = message not in self.said
        self.said.add(message)
        self.tracker.say_in_report(message, logging.WARNING if first else logging.INFO)

    def refuse(self, layer: int, problem: str) -> None:
        """A call that cannot run sparse: strict raises, otherwise the reason is logged once per run."""
        self.tracker.notices.fallback(f"{self.title}: layer {layer} runs dense: {problem}", None, self.config.strict)

    def decide(self, layer: int, attn: torch.nn.Module, args: dict, ctx: CallContext) -> Any:
        """(step, layout, engine config of the step, cond/uncond branch, (sigma, the schedule's next sigma))
        when `choose` lets this call run sparse, else None (the call is counted dense with its reason)."""
        if self.left_to is not None:
            self.tracker.note_block(ctx.step, sparse=False, layer=layer, reason=self.left_to)
            return None
        to = args.get("transformer_options", {})
        x = args["img"]
        precision, why = self.tracker.precision
        self.tracker.log_once(f"precision {precision} ({why})", logging.INFO)
        layout = self.layout(args, ctx)
        reason = self.choose(layer, attn, tuple(x.shape), x.dtype, x.device, layout, self.warmup(ctx),
                             to.get("minimax_head_chunks", 1))
        if reason is None:
            self.note_other_override(to)
            return (ctx.step, layout, self.step_config(ctx), tuple(to.get("cond_or_uncond") or ()),
                    (ctx.sigma, ctx.next_sigma))
        self.tracker.note_block(ctx.step, sparse=False, layer=layer, reason=reason)
        return None

    def note_other_override(self, transformer_options: dict) -> None:
        """Say once per run that another node's attention override does not reach the sparse blocks."""
        override = transformer_options.get("optimized_attention_override")
        if override is not None and model_choice(override) is None:
            self.tracker.log_once("another node's optimized_attention_override applies to dense blocks "
                                  "only; sparse blocks run adaptive sparse attention")

    def prepare(self, attn: torch.nn.Module, dtype: torch.dtype, device: torch.device, layout: SequenceLayout,
                head_chunks: Any, warmup: bool = False) -> None:
        """Compile the kernels of this layout before they run (once per layout, where the kernel family
        compiles any), announced in the console and as progress text on the running node. At a warmup
        step they compile in a child process while the dense steps run (`nodes/warm_start.py`); the
        first sparse step prepares beside a child still running, then stops it (each loads from Triton's
        cache what the other built first). It runs at the head count of one sparse call: the largest of
        KJNodes' head groups (`head_chunks`). Where the sparse blocks run the torch reference kernel, it
        says so once per run (`reference_kernel_notice`)."""
        config, head_dim = self.engine_config, attn.head_dim
        heads = max(h1 - h0 for h0, h1 in head_groups(attn.heads, head_chunks))  # of one sparse call
        notice = layout.cache.get(  # resolved once per layout and call kind, not at every block call
            "reference_notice", (self.config.kernel, self.config.block_size, str(device), dtype, head_dim),
            lambda: reference_kernel_notice(resolve_family(config.kernel, device, dtype, head_dim=head_dim,
                                                           block_size=config.block_size),
                                            self.config, device, dtype, head_dim))
        if notice is not None:  # once per run, in the console (WARNING) and in the run's report
            self.tracker.say_in_report(notice)

        def from_memory() -> float | None:
            return prepare_from_memory(layout, config, dtype, device, head_dim, heads)

        with outside_allocation_graph():
            if warmup and start_during_warmup(self.warm_start, layout, config, dtype, device, head_dim, heads,
                                              from_memory):
                return
            take_over_before_sparse(self.warm_start, layout, config, dtype, device, head_dim, heads, progress_text,
                                    from_memory)
            prepare_kernels(layout, config, dtype, device, head_dim, heads, announce=progress_text)

    def dense_args(self, args: dict) -> dict:
        """Args whose attention runs on the fastest exact kernel (``dense_attention="fastest"``),
        unless another node's override already decides the dense attention. ModelAttentionBackend's
        choice is followed as ComfyUI's launch attention is: a candidate within the run's precision."""
        to = args.get("transformer_options", {})
        if self.left_to is not None:  # the attention ComfyUI (or the core sparse node) sets, untouched
            return args
        override = to.get("optimized_attention_override")
        if self.config.dense_attention != "fastest" or isinstance(override, DenseOverride):
            return args
        if override is not None and (self.dense_override.chosen is None
                                     or model_choice(override) is not self.dense_override.chosen):
            self.tracker.log_once("another node's optimized_attention_override runs the dense blocks "
                                  "(dense_attention='fastest' does not replace it)")
            return args
        return dict(args, transformer_options=dict(to, optimized_attention_override=self.dense_override))

    def attend(self, layer: int, token: Any, attn: torch.nn.Module, x: Any, rope_freqs: Any,
               transformer_options: dict, fallback: Callable) -> torch.Tensor:
        """Sparse attention of block input x, then out_proj (`output`). The first call of a layout in
        a run measures the density, the second is timed against dense attention for the report.
        Eager inside a compiled model too (its caller, `HookedAttention`, is skipped by torch.compile)."""
        step, layout, config, branch, sigmas = token
        timer = self.tracker.start_timer(x[0] if isinstance(x, list) else x)
        key = (layout.signature(), config.topk_ratio)
        tracker = self.tracker

        density = tracker.densities.get(key)
        timed = key in tracker.timed
        group = 0  # the head group of the next `run` (its plan slot)

        kernel = dict(choices=self.sparse_choices, ran=tracker.note_sparse_kernel)

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
            nonlocal density, group
            slot = None if config.plan_reuse != "on" else tracker.plans.slot((branch, layer, layout.signature(), group))
            if slot is not None:
                slot.at(*sigmas)
            group += 1
            if density is None:  # measured once per shape, density and run: it needs a host sync
                o, info = sparse_attention(q, k, v, layout, config, return_info=True, coarse_gate=g, plan_slot=slot,
                                           **kernel)
                density = tracker.densities.setdefault(key, info.density)
            elif not timed:  # the next call (kernels compiled): vs dense
                o, sparse_ms, dense_ms = timed_against_dense(q, k, v, layout, config, g, slot, **kernel)
                tracker.note_timing(key, sparse_ms, dense_ms)
            else:
                o = sparse_attention(q, k, v, layout, config, coarse_gate=g, plan_slot=slot, **kernel)
            return o

        out = self.output(attn, x, rope_freqs, transformer_options, run, layout, config)
        tracker.stop_timer(timer)
        tracker.note_block(step, sparse=True, density=density, layer=layer)
        return out

    def output(self, attn: torch.nn.Module, x: Any, rope_freqs: Any, transformer_options: dict,
               run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
               layout: SequenceLayout, config: SparseConfig) -> torch.Tensor:
        """The attention output [S, hidden] of block input x (or KJNodes' one-item list, freed early):
        Q/K/V per head group (``minimax_head_chunks``, the epilogue the layout's kernels give), `run(q, k, v,
        gate)` -> [1, h, S, D] on each, then out_proj."""
        x = unwrap_input(x)
        heads, dim = attn.heads, attn.head_dim
        norm_rope = layout_kernels(layout, config, x.device, x.dtype, dim).norm_rope
        with outside_allocation_graph():
            out = x.new_empty(x.shape[0], heads, dim)
            gate = coarse_gate(attn, x, self.config)
            with qkv_projection(attn.qkv_proj, x, heads, dim) as projection:
                qw, kw = on_device(attn.q_norm.weight, x.device), on_device(attn.k_norm.weight, x.device)
                for h0, h1 in head_groups(heads, transformer_options.get("minimax_head_chunks", 1)):
                    q, k, v = produce_qkv(x, projection, None, heads, dim, qw, kw, attn.q_norm.eps, rope_freqs,
                                          (h0, h1), norm_rope=norm_rope)
                    g = None if gate is None else gate[:, h0:h1]
                    o = run(q, k, v, g)
                    out[:, h0:h1] = o[0].transpose(0, 1)
                    del q, k, v, o, g
            del x, gate
        return attn.out_proj(out.view(out.shape[0], heads * dim))



def coarse_gate(attn: torch.nn.Module, x: torch.Tensor, config: SparseConfig) -> torch.Tensor | None:
    """The learned gate of the coarse branch for block input x, [1, H, S, D], or None.

    Blocks of distilled FastH3 (VSA) checkpoints carry ``attn.to_gate_compress``, a bias-free
    Linear(hidden, H * D) of the attention input; the attention output is then
    O_sparse + g * C with C the coarse branch. Only ``tail="coarse"`` uses it.
    """
    layer = getattr(attn, "to_gate_compress", None)
    if config.tail != "coarse" or layer is None:
        return None
    g = layer(x)  # the layer's own forward: any op class (GGUF, quantised, LoRA) computes it as the model does
    return g.view(x.shape[0], attn.heads, attn.head_dim).transpose(0, 1).unsqueeze(0)


def timed_against_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                        config: SparseConfig, gate: torch.Tensor | None, slot: PlanSlot | None = None,
                        **kernel: Any) -> tuple[torch.Tensor, float, float]:
    """One sparse call timed against torch's dense SDPA on the same tensors (for the run report).

    Dense attention runs on the first head only and is scaled by the number of heads, to keep the
    extra cost to one head's attention. Synchronises the device three times. `kernel`: `sparse_attention`'s
    ``choices`` and ``ran``.
    Returns (sparse output, sparse ms, dense ms for all heads of q).
    """
    def now() -> float:
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
        return time.perf_counter()

    t0 = now()
    out = sparse_attention(q, k, v, layout, config, coarse_gate=gate, plan_slot=slot, **kernel)
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


def comfy_user_dir() -> str | None:
    """ComfyUI's user directory when ComfyUI is loaded, else None."""
    try:
        import folder_paths
        return folder_paths.get_user_directory()
    except (ImportError, AttributeError):
        return None


def comfy_cache_path() -> Path:
    """Where the measured dense-kernel choices are saved: under ComfyUI's user directory when ComfyUI
    is loaded (``ADAPTIVE_SPARSE_DENSE_CACHE`` still overrides), else the pack's default."""
    return default_cache_path(comfy_user_dir())


def apply_sparse_attention(model_patcher: Any, config: SparseConfig) -> Any:
    """A clone of an H3 ModelPatcher whose blocks run adaptive sparse attention under `config`."""
    hook = SparseAttentionHook(config)
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    gated = gated_blocks(diffusion_model)
    if gated and config.tail != "coarse":
        message = fasth3_message(hook.title, gated, len(diffusion_model.blocks))
        if config.strict:
            raise ValueError(f"{message}. strict=True refuses to run this node on it")
        hook.announce(message)
    elif gated:
        hook.announce(f"{hook.title}: tail='coarse' on a distilled FastH3 checkpoint runs this node's tiling "
                      f"({config.tiling}) with the checkpoint's coarse gate; the weights were trained for VSA's "
                      "pattern (4x4x4-token cubes, 10% kept), which ComfyUI's core 'Model Sparse Attention' node "
                      "runs with method vsa")
    patched = install(model_patcher, hook)
    device = getattr(model_patcher, "load_device", None)
    if isinstance(device, torch.device):  # the child's start-up runs while ComfyUI loads the model and the prompt
        standby_for(hook.warm_start, device, config)
    notice = gate_notice(diffusion_model, config)
    if notice is not None:
        log.warning("%s: %s", hook.title, notice)
        hook.notices.append(notice)
    return patched
