"""The nodes' widgets as plain data: the V3 schemas are built from it, tests read it without ComfyUI.

The sparse node's widgets map one to one onto `SparseConfig` fields; their defaults, ranges and
choices come from `SparseConfig` and `backend/config.py`, so the node cannot drift from the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..backend.config import (DENSE_ATTENTIONS, REBLOCK_LAYOUTS, ROUTING_SCORES, SPARSE_SCOPES, TAIL_GRANULARITIES, TAILS,
                              TILINGS, WARMUP_MODES, SparseConfig, parse_layer_list)

SPARSE_NODE_ID = "AdaptiveSparseAttentionH3"
SPARSE_NODE_NAME = "Adaptive Sparse Attention (MiniMax-H3)"
CAPTURE_NODE_ID = "CaptureH3Attention"
CAPTURE_NODE_NAME = "Capture H3 Attention"
CATEGORY = "model_patches/attention"


@dataclass(frozen=True)
class Widget:
    """One widget: kind is float, int, combo, string or boolean; advanced ones fold away in the UI."""

    name: str
    kind: str
    default: Any
    tooltip: str
    options: tuple[str, ...] = ()
    min: float | None = None
    max: float | None = None
    step: float | None = None
    advanced: bool = False

    def accepts(self, value: Any) -> bool:
        """Whether `value` is a valid setting of this widget (as stored in a workflow)."""
        if self.kind == "combo":
            return value in self.options
        if self.kind == "boolean":
            return isinstance(value, bool)
        if self.kind == "string":
            return isinstance(value, str)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.kind == "int" and not (isinstance(value, int) and numeric):
            return False
        return numeric and self.min <= value <= self.max


_D = SparseConfig()

SPARSE_WIDGETS: tuple[Widget, ...] = (
    Widget("topk_ratio", "float", _D.topk_ratio, min=0.01, max=1.0, step=0.01,
           tooltip="Fraction of candidate video key blocks each query block attends to exactly; the rest are "
                   "covered by the tail summaries. Lower is faster; 1.0 is exact dense attention."),
    Widget("warmup_mode", "combo", _D.warmup_mode, options=WARMUP_MODES,
           tooltip="fidelity: the first warmup_ratio of denoising steps run dense (the layout of the video is "
                   "decided there). speed: sparse from the first step. dense: never sparse, for A/B comparisons."),
    Widget("sparse_scope", "combo", _D.sparse_scope, options=SPARSE_SCOPES,
           tooltip="target-video: only generated-video queries route over generated-video keys; text, audio "
                   "and references stay exact. joint-video: reference videos are sparse too, each with its own "
                   "budget (reference-to-video)."),
    Widget("tail_granularity", "combo", _D.tail_granularity, options=TAIL_GRANULARITIES,
           tooltip="query: every query scores the summaries of unselected blocks (more faithful). block: one "
                   "shared summary result per query block (cheaper)."),
    Widget("warmup_ratio", "float", _D.warmup_ratio, min=0.0, max=1.0, step=0.01, advanced=True,
           tooltip="Share of denoising steps that run dense in fidelity mode (rounded up to whole steps)."),
    Widget("tiling", "combo", _D.tiling, options=TILINGS, advanced=True,
           tooltip="reblock: per head, an adaptive token layout that groups tokens attending alike, or "
                   "space-time tubes where those hold more attention (about half the error of cube at the same "
                   "ratio; its layout costs some time every step). cube: fixed space-time tiles (no layout cost)."),
    Widget("reblock_layout", "combo", _D.reblock_layout, options=REBLOCK_LAYOUTS, advanced=True,
           tooltip="q_reuse_k: queries reuse the key layout (one layout per head). independent: separate "
                   "query and key layouts."),
    Widget("tail", "combo", _D.tail, options=TAILS, advanced=True,
           tooltip="What stands in for unselected blocks: reweight (anchor-weighted summaries with a mass "
                   "correction), mean (plain mean summaries), none (drop them), coarse (a separate coarse "
                   "branch)."),
    Widget("dense_layers", "string", ",".join(map(str, _D.dense_layers)), advanced=True,
           tooltip="Layers that always run dense, e.g. '0,1' or '0-2,49'. Empty: none."),
    Widget("min_tokens", "int", _D.min_tokens, min=0, max=1 << 22, step=1, advanced=True,
           tooltip="Sequences shorter than this run dense (sparse attention only pays off on long videos)."),
    Widget("block_size", "int", _D.block_size, min=64, max=128, step=64, advanced=True,
           tooltip="Tokens per attention block: 64 (finer selection) or 128."),
    Widget("strict", "boolean", _D.strict, advanced=True,
           tooltip="On: anything that cannot run sparse (head size, dtype, device, unknown layout) stops with "
                   "an error. Off: that block runs dense and the reason is logged once per run."),
    Widget("dense_attention", "combo", _D.dense_attention, options=DENSE_ATTENTIONS, advanced=True,
           tooltip="fastest: blocks that run dense (warmup steps, dense layers, short sequences) use the fastest "
                   "exact attention kernel of this GPU, measured once per shape (the same result up to bf16 "
                   "rounding). comfyui: they use ComfyUI's own attention path."),
    Widget("routing_scores", "combo", _D.routing_scores, options=ROUTING_SCORES, advanced=True,
           tooltip="fp32: exact block scores for choosing the key blocks. int8 / fp8: cheaper 8-bit scores "
                   "(fp8 needs an RTX 40xx, Hopper or Blackwell GPU); they pick nearly the same blocks."),
)

CAPTURE_WIDGETS: tuple[Widget, ...] = (
    Widget("layers", "string", "24",
           tooltip="Blocks whose attention inputs are saved, e.g. '0,24,49' or '10-12'."),
    Widget("steps", "string", "10",
           tooltip="Denoising steps (0-based, a CFG pair counts once) at which they are saved."),
    Widget("filename_prefix", "string", "h3_attention/capture",
           tooltip="File name prefix in ComfyUI's output folder; one safetensors file per captured step."),
)


def config_from_widgets(values: dict[str, Any]) -> SparseConfig:
    """The `SparseConfig` of the sparse node's widget values (validated by SparseConfig)."""
    missing = [w.name for w in SPARSE_WIDGETS if w.name not in values]
    if missing:
        raise ValueError(f"{SPARSE_NODE_NAME}: missing widget values {missing}")
    return SparseConfig(**{w.name: values[w.name] for w in SPARSE_WIDGETS})


def capture_selection(layers: str, steps: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Layer and step indices of the capture node's widgets."""
    chosen = (parse_layer_list(layers, f"{CAPTURE_NODE_NAME}.layers"), parse_layer_list(steps, f"{CAPTURE_NODE_NAME}.steps"))
    for name, picked in zip(("layers", "steps"), chosen):
        if not picked:
            raise ValueError(f"{CAPTURE_NODE_NAME}.{name} is empty: expected indices such as '0,24,49'")
    return chosen
