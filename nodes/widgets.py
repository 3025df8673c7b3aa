"""The nodes' widgets as plain data: the V3 schemas are built from it, tests read it without ComfyUI.

The sparse node's widgets map one to one onto `SparseConfig` fields; their defaults, ranges and
choices come from `SparseConfig` and `backend/config.py`, so the node cannot drift from the engine.
The checks the nodes run on widget values (bounded index lists, the capture prefix, layers the
model has) live here too, so they are tested without ComfyUI.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..backend.config import (DENSE_ATTENTIONS, MAX_LAYERS, MAX_MIN_TOKENS, MAX_STEPS, REBLOCK_LAYOUTS,
                              ROUTING_SCORES, SPARSE_SCOPES, TAIL_GRANULARITIES, TAILS, TILINGS, WARMUP_MODES,
                              SparseConfig, check_indices, parse_layer_list, show)

SPARSE_NODE_ID = "AdaptiveSparseAttentionH3"
SPARSE_NODE_NAME = "Adaptive Sparse Attention (MiniMax-H3)"
RAYLIGHT_NODE_ID = "AdaptiveSparseAttentionH3Raylight"
RAYLIGHT_NODE_NAME = "Adaptive Sparse Attention (MiniMax-H3, Raylight)"
CAPTURE_NODE_ID = "CaptureH3Attention"
CAPTURE_NODE_NAME = "Capture H3 Attention"
CATEGORY = "model_patches/attention"
# extra words the node search matches (method and product names users look for)
SPARSE_SEARCH_ALIASES = ("sparse attention", "block sparse attention", "adaptive sparse", "sol", "sol attention",
                         "vsa", "video sparse attention", "spark", "reblock", "minimax h3", "h3 attention")
CAPTURE_SEARCH_ALIASES = ("capture attention", "save qkv", "attention dump", "h3 attention inputs")
REPORT_NODE_ID = "SparseAttentionReportH3"
REPORT_NODE_NAME = "Sparse Attention Report"
REPORT_SEARCH_ALIASES = ("sparse attention report", "attention stats", "density", "sparse status")


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
                   "correction), mean (plain mean summaries), none (drop them), coarse (the coarse branch scaled "
                   "by the model's learned gate; only distilled FastH3 checkpoints carry one, else it adds nothing)."),
    Widget("dense_layers", "string", ",".join(map(str, _D.dense_layers)), advanced=True,
           tooltip="Layers that always run dense, e.g. '0,1' or '0-2,49'. Empty: none."),
    Widget("min_tokens", "int", _D.min_tokens, min=0, max=MAX_MIN_TOKENS, step=1, advanced=True,
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


MAX_PREFIX_CHARS = 200  # characters of the capture node's filename_prefix


def layer_bound(num_layers: int | None) -> tuple[int, str]:
    """(limit, where it comes from) for layer indices: the model's block count, else MAX_LAYERS."""
    if num_layers is None:
        return MAX_LAYERS, f"at most {MAX_LAYERS} layers"
    return num_layers, f"the model has {num_layers} layers"


def model_layer_count(model: Any) -> int | None:
    """Number of DiT blocks of a ComfyUI MODEL (ModelPatcher), or None when it has no block list
    (the H3 check of the patch then says what is wrong)."""
    get = getattr(model, "get_model_object", None)
    try:
        blocks = getattr(get("diffusion_model"), "blocks", None) if callable(get) else None
    except (AttributeError, KeyError):
        return None
    return len(blocks) if blocks is not None and hasattr(blocks, "__len__") else None


def check_dense_layers(config: SparseConfig, num_layers: int | None) -> None:
    """Raise ValueError naming the dense_layers the model does not have."""
    check_indices(config.dense_layers, f"{SPARSE_NODE_NAME}.dense_layers", *layer_bound(num_layers))


def capture_selection(layers: str, steps: str, num_layers: int | None = None
                      ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Layer and step indices of the capture node's widgets, layers below the model's block count
    (MAX_LAYERS when unknown) and steps below MAX_STEPS."""
    chosen = (parse_layer_list(layers, f"{CAPTURE_NODE_NAME}.layers", *layer_bound(num_layers)),
              parse_layer_list(steps, f"{CAPTURE_NODE_NAME}.steps", MAX_STEPS, f"at most {MAX_STEPS} steps"))
    for name, text, picked in zip(("layers", "steps"), (layers, steps), chosen):
        if not picked:
            raise ValueError(f"{CAPTURE_NODE_NAME}.{name}={show(text)} is empty: expected indices such as '0,24,49'")
    return chosen


def check_prefix(prefix: str) -> str:
    """The capture node's filename_prefix when it is a short printable string (the output-folder
    containment is checked where the folder is known)."""
    field = f"{CAPTURE_NODE_NAME}.filename_prefix"
    if not isinstance(prefix, str):
        raise TypeError(f"{field}={show(prefix)} is not allowed: expected a string, got {type(prefix).__name__}")
    if not prefix.strip() or len(prefix) > MAX_PREFIX_CHARS or not prefix.isprintable():
        raise ValueError(f"{field}={show(prefix)} is not allowed: expected 1-{MAX_PREFIX_CHARS} printable characters "
                         "such as 'h3_attention/capture'")
    return prefix


def validation_answer(check: Callable[[], Any]) -> bool | str:
    """What a node's `validate_inputs` returns to ComfyUI: True, or the message of the ValueError
    or TypeError `check` raised. ComfyUI then refuses the prompt before anything runs."""
    try:
        check()
    except (TypeError, ValueError) as err:
        return str(err)
    return True
