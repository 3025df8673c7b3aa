"""`SparseConfig`: the settings of adaptive block-sparse attention, each declared once.

A field's declaration holds all its facts: name, type, default, the rule its values must pass
(`rules.py`: a range or the choices) and its one-paragraph meaning. The node's widgets take their
bounds, choices, defaults and tooltips from these declarations (`nodes/widgets.py`), so the node
cannot drift from the engine. Tests, the benchmark and users build the config directly; a bad
value raises ValueError naming the field, the value and what is allowed, so a mistyped workflow
fails loudly instead of silently running something else.
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass, field, fields
from typing import Any

from ..errors import SparseAttentionError
from ..kernels.registry import FAMILIES
from .rules import Choice, Flag, Integer, LayerIndices, Number, Rule

WARMUP_MODES = ("fidelity", "speed", "dense", "ramp")  # append only: saved workflows store the value
PLAN_REUSES = ("off", "on", "auto")  # append only: saved workflows store the value
SPARSE_SCOPES = ("target-video", "joint-video")
TAIL_GRANULARITIES = ("query", "block")
TILINGS = ("reblock", "cube")
REBLOCK_LAYOUTS = ("q_reuse_k", "independent")
TAILS = ("reweight", "mean", "none", "coarse")
BLOCK_SIZES = (64, 128)
KERNELS = ("auto", *FAMILIES)  # auto or an implementation family of the one table (kernels/registry.py)
DENSE_ATTENTIONS = ("fastest", "comfyui")
ROUTING_SCORES = ("fp32", "int8", "fp8")
PRECISIONS = ("auto", "bf16", "8-bit")
TARGET_RATIOS = (0.05, 0.5)  # the ratios an error target moves a block's topk_ratio between (nodes/error_target.py)
MAX_MIN_TOKENS = 1 << 22  # largest min_tokens a (possibly hostile) workflow or script may ask for


@dataclass(frozen=True)
class Setting:
    """What one field of SparseConfig is: its default, the rule its values pass, and its meaning
    (shown as the node widget's tooltip)."""

    default: Any
    rule: Rule
    meaning: str


def setting(default: Any, rule: Rule, meaning: str) -> Any:
    """Declare a SparseConfig field: its default, the rule every value must pass and what it means.

    Args:
        default: the value when the field is not given (passes `rule`).
        rule: the range or choices the field accepts.
        meaning: what the field does, in the words the node's tooltip shows a user.
    Returns:
        The dataclass field carrying the declaration.
    """
    return field(default=default, metadata={"setting": Setting(default, rule, meaning)})


@dataclass(frozen=True)
class SparseConfig:
    """Configuration of adaptive block-sparse attention (the node's widgets).

    Every field is declared with `setting(default, rule, meaning)`; `settings()` lists the
    declarations. Values are checked and normalised when the config is built (NumPy scalars and
    one-element tensors become Python values; "0-2,49" becomes a tuple of layer indices).
    """

    topk_ratio: float = setting(0.2, Number(0.01, 1.0),
        "Fraction of candidate video key blocks each query block attends to exactly; the rest are covered by "
        "the tail summaries. Lower is faster; 1.0 is exact dense attention.")
    warmup_mode: str = setting("fidelity", Choice(WARMUP_MODES),
        "fidelity: the first warmup_ratio of denoising steps run dense (the layout of the video is decided "
        "there). speed: sparse from the first step. dense: never sparse, for A/B comparisons. ramp: the first "
        "step dense, then the density falls with the sigma to topk_ratio at the end of the warmup_ratio share "
        "(for few-step runs, where a dense warmup is a large share of the time).")
    warmup_ratio: float = setting(0.2, Number(0.0, 1.0),
        "Share of the denoising schedule that runs dense in fidelity mode: calls whose sigma is above the "
        "model's sigma at this share (as ComfyUI's start/end percent); with the simple scheduler the first "
        "ceil(ratio x steps) steps. Split sampler runs keep the dense steps of the whole run.")
    sparse_scope: str = setting("target-video", Choice(SPARSE_SCOPES),
        "target-video: only generated-video queries route over generated-video keys; text, audio and "
        "references stay exact. joint-video: reference videos are sparse too, each with its own budget "
        "(reference-to-video).")
    tail_granularity: str = setting("query", Choice(TAIL_GRANULARITIES),
        "query: every query scores the summaries of unselected blocks (more faithful). block: one shared "
        "summary result per query block (cheaper).")
    tiling: str = setting("reblock", Choice(TILINGS),
        "reblock: per head, an adaptive token layout that groups tokens attending alike, or space-time tubes "
        "where those hold more attention (a lower error than cube at the same ratio; its layout costs "
        "some time every step). cube: fixed space-time tiles (no layout cost).")
    reblock_layout: str = setting("q_reuse_k", Choice(REBLOCK_LAYOUTS),
        "q_reuse_k: queries reuse the key layout (one layout per head). independent: separate query and key "
        "layouts.")
    tail: str = setting("reweight", Choice(TAILS),
        "What stands in for unselected blocks: reweight (anchor-weighted summaries with a mass correction), "
        "mean (plain mean summaries), none (drop them), coarse (the coarse branch scaled by the model's "
        "learned gate; only distilled FastH3 checkpoints carry one, else it adds nothing).")
    dense_layers: tuple[int, ...] = setting((), LayerIndices(),
        "Layers that always run dense, e.g. '0,1' or '0-2,49'. Empty: none.")
    min_tokens: int = setting(12288, Integer(0, MAX_MIN_TOKENS),
        "Sequences shorter than this run dense (sparse attention only pays off on long videos).")
    block_size: int = setting(64, Choice(BLOCK_SIZES),
        "Tokens per attention block: 64 (finer selection) or 128.")
    strict: bool = setting(False, Flag(),
        "On: anything that cannot run sparse (head size, dtype, device, unknown layout) stops with an error. "
        "Off: that block runs dense and the reason is logged once per run.")
    kernel: str = setting("auto", Choice(KERNELS),
        "The kernels every stage runs, the planner's included: auto picks the first that runs on the "
        "device and dtype, and for the attention the fastest kernel of this GPU within the precision setting's "
        "error bound, measured once per shape (cuDNN-frontend, Triton bf16, Triton 8-bit); triton, cudnn or torch "
        "(the pure-torch reference, on every device) by name. In the node, where no fast kernel runs (the CPU, a GPU "
        "without Triton) the sparse blocks run dense on the fastest dense kernel, said once per run, unless torch is "
        "asked for by name (correct, but slower than dense attention).")
    dense_attention: str = setting("fastest", Choice(DENSE_ATTENTIONS),
        "fastest: blocks that run dense (warmup steps, dense layers, short sequences) use the fastest attention "
        "kernel of this GPU that meets the precision setting, measured once per shape: SDPA's kernels, "
        "FlashAttention-4 where installed, and ComfyUI's own attention as launched, so a steady dense step is not "
        "slower than without this node (a kernel's first use in a process can be). comfyui: they use ComfyUI's "
        "own attention path.")
    routing_scores: str = setting("fp32", Choice(ROUTING_SCORES),
        "fp32: exact block scores for choosing the key blocks. int8 / fp8: cheaper 8-bit scores (fp8 needs "
        "an RTX 40xx, Hopper or Blackwell GPU); they pick nearly the same blocks.")
    precision: str = setting("auto", Choice(PRECISIONS),
        "Arithmetic of attention. auto: 8-bit when ComfyUI itself runs 8-bit attention (launched with "
        "--use-sage-attention or --use-ck-attention, or an 8-bit attention another node installed), else bf16; "
        "outside ComfyUI auto means bf16. Dense steps: the fastest kernel within the precision's error bound, "
        "ComfyUI's own attention among the candidates. Sparse steps: with kernel auto likewise (a bf16 kernel meets "
        "the 8-bit bound too); the 8-bit loop: INT8 Q.K^T after smoothing K, FP8 "
        "(INT8 before RTX 40xx) P.V, fp32 softmax statistics and accumulation over the selected video key blocks; "
        "context keys, summaries and routing keep their precision.")
    plan_reuse: str = setting("auto", Choice(PLAN_REUSES),
        "on: a block keeps its tiling and key-block choice from its last evaluated step (per cond/uncond branch "
        "and shape) while a cheap check on the GPU says its block statistics have not moved enough to change them, "
        "and rebuilds them when they have (saves planner time; the run report counts the rebuilds); the kept plans "
        "hold at most 5% of the GPU's memory, blocks past that plan afresh. auto: on where the whole run's kept "
        "plans fit that budget (the first plan's size x sparse blocks x branches x head groups, decided once per "
        "run and shape, said in the console and report with the numbers), else off, so the memory stays with "
        "sampling. off: planned afresh at every step.")
    measure_error: bool = setting(True, Flag(),
        "On: every sparse call also runs a few sampled query blocks per head exactly against all keys (about "
        "1-2% of the call) and measures its own error on them, the relative L2 of the video rows "
        "against dense attention, shown in the run's report. Off: nothing is measured.")
    error_target: float = setting(0.0, Number(0.0, 1.0),
        "0: off, topk_ratio decides. Above 0: the error the run should hold (relative L2 of the video rows against "
        "dense attention, as measure_error reports it; about 0.05-0.1 is what topk_ratio 0.2 gives on test scenes): "
        "each block starts at topk_ratio (which must be within 0.05-0.5), then steps its ratio between 0.05 and 0.5 "
        "toward the target, learning from the errors it measured at its earlier ratios how fast the error falls, "
        "and holds it once the estimate is within 15% (a target out of reach holds 0.05 or 0.5). Ramp steps teach "
        "it nothing. Needs measure_error on.")
    backend: InitVar[str | None] = None  # the old name of `kernel`: refused with a message that says so

    def __post_init__(self, backend: str | None) -> None:
        if backend is not None:
            raise SparseAttentionError(f"SparseConfig.backend={backend!r}: the field is now called kernel "
                                       f"(SparseConfig(kernel={backend!r})); allowed: {', '.join(map(repr, KERNELS))}")
        for name, declared in settings().items():
            object.__setattr__(self, name, declared.rule.check(f"SparseConfig.{name}", getattr(self, name)))
        if self.error_target > 0 and not self.measure_error:
            raise SparseAttentionError(f"SparseConfig.error_target={self.error_target} is not allowed with "
                                       "measure_error=False: the target is held from the measured error; allowed: "
                                       "measure_error=True, or error_target=0")
        lo, hi = TARGET_RATIOS
        if self.error_target > 0 and not lo <= self.topk_ratio <= hi:
            raise SparseAttentionError(f"SparseConfig.topk_ratio={self.topk_ratio} is not allowed with "
                                       f"error_target={self.error_target}: the target moves each block's ratio "
                                       f"between {lo} and {hi}, starting at topk_ratio; allowed: topk_ratio in "
                                       f"[{lo}, {hi}], or error_target=0")

    @property
    def exact_precision(self) -> str:
        """The exact loop's arithmetic as the kernels take it: "bf16" (the inputs' own precision; what
        `auto` means inside the engine) or "8-bit"."""
        return "8-bit" if self.precision == "8-bit" else "bf16"

    def replace(self, **changes: Any) -> "SparseConfig":
        """A copy with some fields changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(values) - {"backend"}  # the old name: the constructor says what it became
        if unknown:
            raise SparseAttentionError(f"SparseConfig has no field(s) {sorted(unknown)}; fields are {sorted(values)}")
        values.update(changes)
        return SparseConfig(**values)


def settings() -> dict[str, Setting]:
    """Every SparseConfig field's declaration, in field order.

    Returns:
        field name -> its Setting (default, rule, meaning).
    Raises:
        TypeError: a field was declared without `setting(...)`, so it would go unchecked.
    """
    declared = {f.name: f.metadata.get("setting") for f in fields(SparseConfig)}
    missing = [name for name, s in declared.items() if s is None]
    if missing:
        raise TypeError(f"SparseConfig fields {missing} are declared without setting(default, rule, meaning)")
    return declared
