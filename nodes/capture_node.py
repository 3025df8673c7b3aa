"""The "Capture H3 Attention" node: saves real Q/K/V of chosen blocks and steps for offline evaluation.

The hook produces q, k, v (after RMS-norm and RoPE) with the same producer the sparse path uses,
keeps CPU copies, and lets the block's attention run unchanged (an observer hook: it sees the calls
the sparse node takes in either node order, `BlockHook.observes`). Entries of one denoising step are
written together (one safetensors file per step, via `nodes.capture.save_capture`) into
ComfyUI's output folder, so host memory holds at most one step's captures. Only the conditional
call of a CFG pair is captured.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from comfy_api.latest import io

from ..errors import SparseAttentionError
from ..backend.layout import SequenceLayout
from ..backend.producer import produce_qkv
from ..notices import logger
from .comfy_weights import on_device, qkv_projection, unwrap_input
from .model_patches import install
from .h3_model import h3_diffusion_model
from .block_hook import STATE_ATTR, BlockHook, CallContext
from .error_meter import relative
from .schema import io_input
from .widgets import (CAPTURE_NODE_ID, CAPTURE_NODE_NAME, CAPTURE_SEARCH_ALIASES, CAPTURE_WIDGETS, CATEGORY,
                      capture_selection, check_prefix, model_layer_count, validation_answer)

log = logger()


class CaptureHook(BlockHook):
    """Copies q, k, v of the chosen (layer, step) calls and writes them per step."""

    kind = "capture"
    observes = True  # before or after the sparse node, it captures the same q, k, v

    def __init__(self, layers: tuple[int, ...], steps: tuple[int, ...], filename_prefix: str, output_dir: str):
        self.layers, self.steps = set(layers), set(steps)
        self.folder = os.path.abspath(os.path.join(output_dir, os.path.dirname(os.path.normpath(filename_prefix))))
        self.base = os.path.basename(os.path.normpath(filename_prefix))
        if os.path.commonpath([self.folder, os.path.abspath(output_dir)]) != os.path.abspath(output_dir) or not self.base:
            raise SparseAttentionError(f"{CAPTURE_NODE_NAME}.filename_prefix={filename_prefix!r} must name a file inside the "
                             "output folder, e.g. 'h3_attention/capture'")
        super().__init__()

    def start_state(self, parent: BlockHook | None) -> None:
        """Fresh per-model state (see `BlockHook.start_state`): nothing pending."""
        super().start_state(parent)
        self.pending: list[dict[str, Any]] = []
        self.pending_layout: SequenceLayout | None = None
        self.pending_model: Any = None  # the diffusion model the pending entries ran on
        self.meta: dict[str, Any] = {}

    @property
    def title(self) -> str:
        """The node's display name (log messages)."""
        return CAPTURE_NODE_NAME

    def decide(self, layer: int, attn: torch.nn.Module, args: dict, ctx: CallContext) -> Any:
        """(step, total steps so far, layout, sigma) for the conditional call of a chosen (layer, step)
        not yet captured, else None."""
        to = args.get("transformer_options", {})
        if layer not in self.layers or ctx.step not in self.steps or 1 in to.get("cond_or_uncond", [0]):
            return None
        if any(e["layer"] == layer and e["step"] == ctx.step for e in self.pending):
            return None
        layout = self.layout(args, ctx)
        if layout is None or layout.total != args["img"].shape[0]:
            self.tracker.log_once(f"layer {layer} step {ctx.step}: no matching sequence layout, not captured")
            return None
        return ctx.step, len(self.tracker.run_sigmas) - 1, layout, ctx.sigma, ctx.model

    def attend(self, layer: int, token: Any, attn: torch.nn.Module, x: Any, rope_freqs: Any,
               transformer_options: dict, fallback: Callable) -> torch.Tensor:
        """Keep CPU copies of the call's q, k, v (written when its step ends), then run the block's own
        attention unchanged."""
        step, total, layout, sigma, model = token
        x = unwrap_input(x)
        if self.pending and (self.pending[0]["step"] != step or self.pending_layout != layout):
            self.flush()
        with qkv_projection(attn.qkv_proj, x, attn.heads, attn.head_dim) as projection:
            q, k, v = produce_qkv(x, projection, None, attn.heads, attn.head_dim,
                                  on_device(attn.q_norm.weight, x.device), on_device(attn.k_norm.weight, x.device),
                                  attn.q_norm.eps, rope_freqs)
        self.pending.append({"layer": layer, "step": step, "q": q.cpu(), "k": k.cpu(), "v": v.cpu()})
        self.pending_layout, self.pending_model = layout, model
        self.meta = {"model": "MiniMax-H3", "total_steps": total, "call": "cond", "heads": attn.heads,
                     "head_dim": attn.head_dim, "dtype": str(x.dtype),
                     "sigmas": {**self.meta.get("sigmas", {}), str(step): sigma}}
        return fallback(x, rope_freqs=rope_freqs, transformer_options=transformer_options)

    def flush(self) -> None:
        """Write the pending entries (one step) to a new file in the output folder."""
        if not self.pending:
            return
        from .capture import save_capture

        os.makedirs(self.folder, exist_ok=True)
        step, counter = self.pending[0]["step"], 1
        while os.path.exists(path := os.path.join(self.folder, f"{self.base}_{counter:05d}_step{step:03d}.safetensors")):
            counter += 1
        errors = self.measured_errors()
        save_capture(path, self.pending, self.pending_layout, dict(self.meta, **({"measured_error": errors} if errors else {})))
        log.info("%s: wrote %d entries to %s", self.title, len(self.pending), path)
        self.pending, self.pending_layout, self.pending_model, self.meta = [], None, None, {}

    def measured_errors(self) -> dict[str, list[float]]:
        """The sparse node's sampled error of each pending (layer, step), per head (relative L2 of the video rows,
        both branches), keyed "layer/step", where a hook on the same model measured one (read from the device once
        a file)."""
        found = {}
        hooks = getattr(self.pending_model, "__dict__", {}).get(STATE_ATTR, {}).values()
        for hook in hooks:
            sums = hook.tracker.stats.errors.sums
            for e in self.pending:
                if (e["step"], e["layer"]) in sums:
                    found[f"{e['layer']}/{e['step']}"] = relative(sums[(e["step"], e["layer"])].cpu()).tolist()
        return found

    def on_cleanup(self, patcher: Any) -> None:
        """End of sampling: write what is pending, then end the run."""
        self.flush()
        super().on_cleanup(patcher)


class CaptureH3Attention(io.ComfyNode):
    """Saves Q/K/V and the sequence layout of chosen MiniMax-H3 blocks and steps."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        """The node's V3 schema (widgets from `widgets.CAPTURE_WIDGETS`)."""
        return io.Schema(
            node_id=CAPTURE_NODE_ID,
            display_name=CAPTURE_NODE_NAME,
            category=CATEGORY,
            search_aliases=list(CAPTURE_SEARCH_ALIASES),
            description=("Saves the real attention inputs (q, k, v after norm and RoPE) and the packed-sequence "
                         "layout of the chosen blocks and denoising steps to safetensors files in the output "
                         "folder, for `python install.py evaluate FILE` (in the pack's folder, with ComfyUI's Python). "
                         "Sampling is unchanged. Before or after the Adaptive Sparse Attention node it captures the "
                         "same inputs."),
            inputs=[io.Model.Input("model", tooltip="A MiniMax-H3 model.")] + [io_input(w) for w in CAPTURE_WIDGETS],
            outputs=[io.Model.Output(tooltip="The same model, capturing while it samples.")],
        )

    @classmethod
    def validate_inputs(cls, layers: str | None = None, steps: str | None = None,
                        filename_prefix: str | None = None) -> bool | str:
        """Refuse malformed or unbounded widget strings when the prompt is queued (values linked from
        another node are None here and are checked in `execute`)."""
        def check() -> None:
            if layers is not None and steps is not None:
                capture_selection(layers, steps)
            if filename_prefix is not None:
                check_prefix(filename_prefix)

        return validation_answer(check)

    @classmethod
    def execute(cls, model, layers: str, steps: str, filename_prefix: str) -> io.NodeOutput:
        """A clone of `model` that captures the chosen blocks and steps into ComfyUI's output folder."""
        import folder_paths

        h3_diffusion_model(model, CAPTURE_NODE_NAME)
        chosen_layers, chosen_steps = capture_selection(layers, steps, model_layer_count(model))
        check_prefix(filename_prefix)
        hook = CaptureHook(chosen_layers, chosen_steps, filename_prefix, folder_paths.get_output_directory())
        return io.NodeOutput(install(model, hook))
