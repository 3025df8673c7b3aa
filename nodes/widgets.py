"""The nodes' widgets as plain data: the V3 schemas are built from it, tests read it without ComfyUI.

The sparse node's widgets map one to one onto `SparseConfig` fields; each widget's kind, default,
range or choices and tooltip come from its field's declaration, so the node cannot drift from the
engine; only the order, the step and the advanced flag are the node's own.
The checks the nodes run on widget values (bounded index lists, the capture prefix, layers the
model has) live here too, so they are tested without ComfyUI.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import SparseAttentionError
from ..backend.config import SparseConfig, settings
from ..backend.index_lists import MAX_LAYERS, MAX_STEPS, parse_layer_list
from ..backend.rules import Choice, Flag, Integer, LayerIndices, Number
from ..backend.value_checks import show

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
    optional: bool = False  # a prompt may leave it out: the node then takes `default`

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


def config_widget(name: str, step: float | None = None, advanced: bool = False, optional: bool = False) -> Widget:
    """The widget of SparseConfig field `name`: its kind, default, bounds or choices and tooltip
    are read from the field's declaration (`backend/config.py`), so the two cannot differ.

    Args:
        name: the SparseConfig field.
        step: the increment of a number widget (an int choice's step must walk exactly its choices).
        advanced: whether the widget folds away in the UI.
        optional: whether a prompt may leave it out (an input added after the first release).
    Returns:
        The widget.
    """
    declared = settings()[name]
    rule = declared.rule
    default = ",".join(map(str, declared.default)) if isinstance(rule, LayerIndices) else declared.default
    shown = dict(name=name, default=default, tooltip=declared.meaning, advanced=advanced, optional=optional)
    if isinstance(rule, (Number, Integer)):
        return Widget(kind="float" if isinstance(rule, Number) else "int", min=rule.lo, max=rule.hi, step=step,
                      **shown)
    if isinstance(rule, Choice) and isinstance(rule.choices[0], int):
        return Widget(kind="int", min=min(rule.choices), max=max(rule.choices), step=step, **shown)
    if isinstance(rule, Choice):
        return Widget(kind="combo", options=rule.choices, **shown)
    if isinstance(rule, Flag):
        return Widget(kind="boolean", **shown)
    if isinstance(rule, LayerIndices):  # typed as text, e.g. "0-2,49"
        return Widget(kind="string", **shown)
    raise TypeError(f"SparseConfig.{name}: no widget for a {type(rule).__name__} rule")


# Every SparseConfig field, in the order the node shows them (`kernel` last: the pure-torch reference by name).
# Saved UI workflows fill widgets by position: the order never changes and a new widget goes at the end.
# Widgets added after the first release (0.1.0) are optional, so an API prompt saved before them still
# runs with their defaults; ComfyUI lists optional inputs after the required ones, which keeps this order.
SPARSE_WIDGETS: tuple[Widget, ...] = (
    config_widget("topk_ratio", step=0.01),
    config_widget("warmup_mode"),
    config_widget("sparse_scope"),
    config_widget("tail_granularity"),
    config_widget("warmup_ratio", step=0.01, advanced=True),
    config_widget("tiling", advanced=True),
    config_widget("reblock_layout", advanced=True),
    config_widget("tail", advanced=True),
    config_widget("dense_layers", advanced=True),
    config_widget("min_tokens", step=1, advanced=True),
    config_widget("block_size", step=64, advanced=True),
    config_widget("strict", advanced=True),
    config_widget("dense_attention", advanced=True, optional=True),
    config_widget("routing_scores", advanced=True, optional=True),
    config_widget("precision", optional=True),
    config_widget("plan_reuse", advanced=True, optional=True),
    config_widget("measure_error", advanced=True, optional=True),
    config_widget("error_target", step=0.005, advanced=True, optional=True),
    config_widget("kernel", advanced=True, optional=True),
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
    """The `SparseConfig` of the sparse node's widget values (validated by SparseConfig); an optional
    widget left out (a prompt saved before it existed; None where ComfyUI passes that) takes its default."""
    missing = [w.name for w in SPARSE_WIDGETS if w.name not in values and not w.optional]
    if missing:
        raise SparseAttentionError(f"{SPARSE_NODE_NAME}: missing widget values {missing}")
    return SparseConfig(**{w.name: values[w.name] for w in SPARSE_WIDGETS
                           if w.name in values and not (w.optional and values[w.name] is None)})


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


def check_dense_layers(text: str, num_layers: int | None = None) -> tuple[int, ...]:
    """The sparse node's dense_layers widget text parsed, or ValueError/TypeError naming the widget,
    its text and the layers allowed: those the model has, or at most MAX_LAYERS when the model is not
    known yet (when the prompt is queued). One message for both moments.

    Args:
        text: the widget's text, e.g. "0-2,49".
        num_layers: the model's block count, or None.
    Returns:
        The sorted layer indices.
    """
    return parse_layer_list(text, f"{SPARSE_NODE_NAME}.dense_layers", *layer_bound(num_layers))


def check_block_size(value: Any) -> int:
    """The sparse node's block_size when it is one of SparseConfig's allowed values (ComfyUI's own
    check of an int widget knows only its min and max), else ValueError naming the widget."""
    return settings()["block_size"].rule.check(f"{SPARSE_NODE_NAME}.block_size", value)


def check_queued(dense_layers: str | None = None, block_size: int | None = None, topk_ratio: float | None = None,
                 measure_error: bool | None = None, error_target: float | None = None) -> None:
    """The sparse node's checks when a prompt is queued (its `validate_inputs`): a malformed dense_layers or one
    beyond any model, a block_size that is not allowed, and an error_target the node cannot hold (with
    measure_error off, or a topk_ratio outside the target's range: `SparseConfig`'s message, naming the fields
    and values). A value linked from another node is None here (a left-out optional one too) and takes the
    field's default, which refuses nothing; `execute` checks every value again. Raises ValueError or TypeError."""
    if dense_layers is not None:
        check_dense_layers(dense_layers)
    if block_size is not None:
        check_block_size(block_size)
    given = {"topk_ratio": topk_ratio, "measure_error": measure_error, "error_target": error_target}
    SparseConfig(**{name: value for name, value in given.items() if value is not None})


def capture_selection(layers: str, steps: str, num_layers: int | None = None
                      ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Layer and step indices of the capture node's widgets, layers below the model's block count
    (MAX_LAYERS when unknown) and steps below MAX_STEPS."""
    chosen = (parse_layer_list(layers, f"{CAPTURE_NODE_NAME}.layers", *layer_bound(num_layers)),
              parse_layer_list(steps, f"{CAPTURE_NODE_NAME}.steps", MAX_STEPS, f"at most {MAX_STEPS} steps"))
    for name, text, picked in zip(("layers", "steps"), (layers, steps), chosen):
        if not picked:
            raise SparseAttentionError(f"{CAPTURE_NODE_NAME}.{name}={show(text)} is empty: expected indices such as '0,24,49'")
    return chosen


def check_prefix(prefix: str) -> str:
    """The capture node's filename_prefix when it is a short printable string (the output-folder
    containment is checked where the folder is known)."""
    field = f"{CAPTURE_NODE_NAME}.filename_prefix"
    if not isinstance(prefix, str):
        raise TypeError(f"{field}={show(prefix)} is not allowed: expected a string, got {type(prefix).__name__}")
    if not prefix.strip() or len(prefix) > MAX_PREFIX_CHARS or not prefix.isprintable():
        raise SparseAttentionError(f"{field}={show(prefix)} is not allowed: expected 1-{MAX_PREFIX_CHARS} printable characters "
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
