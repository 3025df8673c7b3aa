"""How the sparse node meets other patches on one model: ComfyUI's core sparse node, FastH3 checkpoints and
other nodes' attention overrides. Each rule is one function the hook calls; none keeps state."""
from __future__ import annotations

import logging
from typing import Any, Callable

from ..backend.config import SparseConfig
from .core_sparse import core_sparse_blocks, core_sparse_message, core_sparse_order, fasth3_message, gated_blocks
from .dense_override import DenseOverride, is_ours
from .precision import model_choice
from .run_tracker import RunTracker


def leave_reason(patcher: Any, config: SparseConfig, title: str, notes: list[str], announce: Callable[[str], None],
                 tracker: RunTracker) -> str | None:
    """Why this sampler call leaves every block's attention to ComfyUI, or None: ComfyUI's core sparse node
    is on the model (it runs the attention), or the checkpoint is a FastH3 one (trained for VSA's pattern;
    tail='coarse' runs ours with its gate). Said at WARNING the first time (`announce`), then once per run
    at INFO (`notes`: what was announced for this model)."""
    order = core_sparse_order(patcher.model_options)
    diffusion_model = patcher.get_model_object("diffusion_model")
    if order is not None:
        message = core_sparse_message(title, order, len(core_sparse_blocks(patcher.model_options)))
        reason = "left to ComfyUI's 'Model Sparse Attention' node, which runs these blocks"
    elif config.tail != "coarse" and gated_blocks(diffusion_model):
        message = fasth3_message(title, gated_blocks(diffusion_model), len(diffusion_model.blocks))
        reason = ("FastH3 checkpoint (to_gate_compress, trained for VSA's pattern): left to ComfyUI's attention; "
                  "ComfyUI's 'Model Sparse Attention' node with vsa runs its pattern")
    else:
        return None
    if message in notes:
        tracker.log_once(message.removeprefix(f"{title}: "), logging.INFO)
    else:
        announce(message)
    return reason


def dense_args(args: dict, config: SparseConfig, dense_override: DenseOverride, tracker: RunTracker,
               preferred: Callable | None = None) -> dict:
    """Args whose attention runs on the fastest exact kernel (``dense_attention="fastest"``), unless another
    node's override already decides the dense attention. ModelAttentionBackend's choice, and the block's
    attention module's own (`preferred`, `precision.module_attention`), are followed as ComfyUI's launch
    attention is: a candidate within the run's precision."""
    to = args.get("transformer_options", {})
    override = to.get("optimized_attention_override")
    if config.dense_attention != "fastest" or is_ours(override):
        return args
    if override is not None and (dense_override.chosen is None or model_choice(override) is not dense_override.chosen):
        tracker.log_once("another node's optimized_attention_override runs the dense blocks "
                         "(dense_attention='fastest' does not replace it)")
        return args
    return dict(args, transformer_options=dict(to, optimized_attention_override=dense_override.preferring(preferred)))


def note_other_override(transformer_options: dict, tracker: RunTracker) -> None:
    """Say once per run that another node's attention override does not reach the sparse blocks."""
    override = transformer_options.get("optimized_attention_override")
    if override is not None and model_choice(override) is None:
        tracker.log_once("another node's optimized_attention_override applies to dense blocks "
                         "only; sparse blocks run adaptive sparse attention")
