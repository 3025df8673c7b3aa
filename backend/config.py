"""`SparseConfig`: every widget of the node, validated in one place.

The node translates its widgets into this object one to one; tests, the benchmark and users
build it directly. A bad value raises `ValueError` naming the field, the value and what is
allowed, so a mistyped workflow fails loudly instead of silently running something else.
"""
from __future__ import annotations

import numbers
import operator
import re
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable

from ..kernels.dispatch import BACKENDS as KERNEL_BACKENDS

WARMUP_MODES = ("fidelity", "speed", "dense")
SPARSE_SCOPES = ("target-video", "joint-video")
TAIL_GRANULARITIES = ("query", "block")
TILINGS = ("reblock", "cube")
REBLOCK_LAYOUTS = ("q_reuse_k", "independent")
TAILS = ("reweight", "mean", "none", "coarse")
BLOCK_SIZES = (64, 128)
BACKENDS = ("auto", *KERNEL_BACKENDS)  # auto or a row of the one dispatch (kernels/dispatch.py)
DENSE_ATTENTIONS = ("fastest", "comfyui")
ROUTING_SCORES = ("fp32", "int8", "fp8")

# Bounds of what a (possibly hostile) workflow or script may ask for, checked before any work.
MAX_LAYERS = 1024  # layer indices are below this when the model is unknown (MiniMax-H3 has 50 blocks)
MAX_STEPS = 10_000  # denoising step indices are below this
MAX_LIST_CHARS = 1024  # characters of an index-list widget such as "0-2,49"
MAX_MIN_TOKENS = 1 << 22  # largest min_tokens
SHOWN_CHARS = 60  # characters of a bad value quoted in an error message

_INDEX_PART = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", re.ASCII)


def show(value: Any) -> str:
    """`repr(value)` cut to SHOWN_CHARS characters, so an error never echoes (or builds) a huge input."""
    if isinstance(value, (str, bytes)) and len(value) > SHOWN_CHARS:
        return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"
    if isinstance(value, (list, tuple, dict, set, frozenset)) and len(value) > 8:
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({type(value).__name__})"


def _fail(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"SparseConfig.{field}={show(value)} is not allowed: expected {allowed}")


def _is_bool(value: Any) -> bool:
    """Any kind of bool: Python's, NumPy's, a bool tensor or array (told by type and dtype, so
    NumPy need not be imported)."""
    t = type(value)
    return (isinstance(value, bool) or (t.__module__ == "numpy" and t.__name__ in ("bool", "bool_"))
            or str(getattr(value, "dtype", "")) in ("torch.bool", "bool"))


def _kind(value: Any) -> str:
    scalar = tuple(getattr(value, "shape", ())) == ()
    return "bool" if _is_bool(value) and scalar else type(value).__name__


def spans(runs: Iterable[tuple[int, int]]) -> str:
    """Inclusive index ranges as text: [(50, 52), (99, 99)] -> '50-52, 99'."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def runs_of(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted indices as inclusive runs of consecutive values: (50, 51, 52, 99) -> [(50, 52), (99, 99)]."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        runs[-1:] = [(runs[-1][0], i)] if runs and runs[-1][1] == i - 1 else runs[-1:] + [(i, i)]
    return runs


def check_indices(indices: tuple[int, ...], field: str, limit: int, what: str) -> None:
    """Raise ValueError naming the indices of the sorted tuple `indices` that are >= `limit`.

    Args:
        indices: sorted non-negative indices.
        field: the widget or argument, for the message.
        limit: every index must be below it.
        what: where `limit` comes from (e.g. "the model has 50 layers"), for the message.
    """
    bad = [i for i in indices if i >= limit]
    if bad:
        raise ValueError(f"{field}: {'index' if len(bad) == 1 else 'indices'} {spans(runs_of(bad))} out of range: "
                         f"expected 0-{limit - 1} ({what})")


def parse_layer_list(text: str, field: str = "SparseConfig.dense_layers", limit: int = MAX_LAYERS,
                     what: str = f"at most {MAX_LAYERS} layers") -> tuple[int, ...]:
    """Parse a widget string such as ``"0, 1, 48-49"`` into sorted unique indices below `limit`.

    The text's length and every index are bounded before a range is expanded, so a hostile
    string is rejected in microseconds; indices at or above `limit` are named in the error.

    Args:
        text: comma-separated ASCII indices or ranges lo-hi (lo <= hi); empty parts are ignored.
        field: the widget in error messages (the capture node parses layers and steps too).
        limit: every index must be below it (the model's layer count, or a fixed maximum).
        what: where `limit` comes from, for the message.
    Returns:
        The sorted unique indices.
    """
    if not isinstance(text, str):
        raise TypeError(f"{field}={show(text)} is not allowed: expected a string such as '0,1,48-49', "
                        f"got {_kind(text)}")
    if len(text) > MAX_LIST_CHARS:
        raise ValueError(f"{field}={show(text)} is not allowed: expected at most {MAX_LIST_CHARS} characters")
    ranges = []
    for part in text.split(","):
        if not part.strip():
            continue
        match = _INDEX_PART.fullmatch(part)
        if match is None:
            raise ValueError(f"{field}={show(text)} is not allowed: {show(part.strip())} is not an index or a range: "
                             "expected comma-separated indices or ranges lo-hi like '0,1,48-49'")
        lo = int(match.group(1))  # at most MAX_LIST_CHARS digits
        hi = lo if match.group(2) is None else int(match.group(2))
        if hi < lo:
            raise ValueError(f"{field}={show(text)} is not allowed: range {lo}-{hi} has lo > hi: expected ranges "
                             "lo-hi with lo <= hi")
        ranges.append((lo, hi))
    bad = sorted((max(lo, limit), hi) for lo, hi in ranges if hi >= limit)
    if bad:
        raise ValueError(f"{field}={show(text)} is not allowed: {spans(bad)} out of range: expected indices "
                         f"0-{limit - 1} ({what})")
    return tuple(sorted({i for lo, hi in ranges for i in range(lo, hi + 1)}))


def as_index(field: str, value: Any, lo: int, hi: int, allowed: str) -> int:
    """`value` as an int in [lo, hi]: ints, NumPy integers and one-element integer tensors pass;
    bools and floats do not (a float where an integer is meant is a mistake, not a rounding)."""
    if _is_bool(value) or isinstance(value, float):
        raise _fail(field, value, f"{allowed}, got {_kind(value)}")
    try:
        i = operator.index(value)
    except TypeError:
        raise _fail(field, value, f"{allowed}, got {_kind(value)}") from None
    if not lo <= i <= hi:
        raise _fail(field, value, allowed)
    return int(i)


Rule = Callable[[str, Any], Any]


def number_rule(lo: float, hi: float) -> Rule:
    """A real number in [lo, hi] (int, float, NumPy scalar; not a bool), normalised to float."""
    allowed = f"a number in [{lo}, {hi}]"

    def rule(field: str, value: Any) -> float:
        if _is_bool(value) or not isinstance(value, numbers.Real):
            raise _fail(field, value, f"{allowed}, got {_kind(value)}")
        if not lo <= value <= hi:  # NaN fails too; compared before float() so a huge int cannot overflow
            raise _fail(field, value, allowed)
        return float(value)

    return rule


def int_rule(lo: int, hi: int) -> Rule:
    """An integer in [lo, hi], normalised to int."""
    return lambda field, value: as_index(field, value, lo, hi, f"an integer in [{lo}, {hi}]")


def choice_rule(choices: tuple[Any, ...]) -> Rule:
    """One of `choices` (all str or all int), normalised to the choices' type."""
    allowed = "one of " + ", ".join(repr(c) for c in choices)

    def rule(field: str, value: Any) -> Any:
        if isinstance(choices[0], int):
            i = as_index(field, value, min(choices), max(choices), allowed)
            if i not in choices:
                raise _fail(field, value, allowed)
            return i
        if not isinstance(value, str):
            raise _fail(field, value, f"{allowed}, got {_kind(value)}")
        if value not in choices:
            raise _fail(field, value, allowed)
        return str(value)

    return rule


def bool_rule(field: str, value: Any) -> bool:
    """True or False: a bool scalar of any kind (0 and 1 are not flags)."""
    if not _is_bool(value) or tuple(getattr(value, "shape", ())) != ():
        raise _fail(field, value, f"True or False, got {_kind(value)}")
    return bool(value)


def layers_rule(field: str, value: Any) -> tuple[int, ...]:
    """Layer indices below MAX_LAYERS from a widget string or a tuple/list/set/range of integers,
    normalised to a sorted tuple of unique ints."""
    if isinstance(value, str):
        return parse_layer_list(value, f"SparseConfig.{field}")
    allowed = (f"a tuple of non-negative layer indices below {MAX_LAYERS} or a string such as '0-2,49'")
    if not isinstance(value, (tuple, list, range, set, frozenset)):
        raise _fail(field, value, f"{allowed}, got {_kind(value)}")
    if len(value) > MAX_LAYERS:
        raise _fail(field, value, f"{allowed}, at most {MAX_LAYERS} of them")
    indices = set()
    for item in value:
        try:
            i = None if _is_bool(item) or isinstance(item, float) else operator.index(item)
        except TypeError:
            i = None
        if i is None or i < 0:
            raise _fail(field, value, f"{allowed}; {show(item)} is not one")
        indices.add(i)
    result = tuple(sorted(indices))
    check_indices(result, f"SparseConfig.{field}", MAX_LAYERS, f"at most {MAX_LAYERS} layers")
    return result


# One rule per field: SparseConfig checks that every field has one, so a new field cannot go unvalidated.
RULES: dict[str, Rule] = {
    "topk_ratio": number_rule(0.01, 1.0),
    "warmup_mode": choice_rule(WARMUP_MODES),
    "warmup_ratio": number_rule(0.0, 1.0),
    "sparse_scope": choice_rule(SPARSE_SCOPES),
    "tail_granularity": choice_rule(TAIL_GRANULARITIES),
    "tiling": choice_rule(TILINGS),
    "reblock_layout": choice_rule(REBLOCK_LAYOUTS),
    "tail": choice_rule(TAILS),
    "dense_layers": layers_rule,
    "min_tokens": int_rule(0, MAX_MIN_TOKENS),
    "block_size": choice_rule(BLOCK_SIZES),
    "strict": bool_rule,
    "backend": choice_rule(BACKENDS),
    "dense_attention": choice_rule(DENSE_ATTENTIONS),
    "routing_scores": choice_rule(ROUTING_SCORES),
}


@dataclass(frozen=True)
class SparseConfig:
    """Configuration of adaptive block-sparse attention (mirrors the node's widgets).

    topk_ratio: fraction of candidate video key blocks computed exactly per query block.
    warmup_mode / warmup_ratio: dense for the first ``warmup_ratio`` of denoising steps
        (`fidelity`), sparse from the first step (`speed`), or never sparse (`dense`).
    sparse_scope: `target-video` routes only target-video queries over target-video keys;
        `joint-video` makes every video region sparse with one TopK group per key region.
    tail_granularity: `query` (every query scores the summaries) or `block` (one shared
        summary result per query block).
    tiling / reblock_layout: the adaptive reblock layout, per head the tree or space-time tubes
        (default: a lower output error than cube tiling at the same ratio, for some planning time
        every step; BENCHMARKS.md, "Reblock quality") or fixed 3D cubes.
    tail: what stands in for unselected candidate blocks.
    dense_layers: layer indices that always run dense; min_tokens: shorter sequences run dense.
    block_size: tokens per block (64 or 128). strict: raise instead of falling back to dense.
    backend: the kernels every stage runs, planner included (`kernels/dispatch.py`): `auto`
        (Triton on CUDA for fp16/bf16/fp32, torch otherwise), `triton` or `torch` (the reference everywhere).
    dense_attention: blocks that run dense use the fastest exact kernel of the GPU, measured
        (`fastest`), or ComfyUI's own attention path (`comfyui`).
    routing_scores: pooled routing scores in `fp32` (exact) or from 8-bit block means, `int8`
        or `fp8` (e4m3, sm89 and later; backend/indexer.py).
    """

    topk_ratio: float = 0.2
    warmup_mode: str = "fidelity"
    warmup_ratio: float = 0.2
    sparse_scope: str = "target-video"
    tail_granularity: str = "query"
    tiling: str = "reblock"
    reblock_layout: str = "q_reuse_k"
    tail: str = "reweight"
    dense_layers: tuple[int, ...] = ()
    min_tokens: int = 12288
    block_size: int = 64
    strict: bool = False
    backend: str = "auto"
    dense_attention: str = "fastest"
    routing_scores: str = "fp32"

    def __post_init__(self) -> None:
        for f in fields(self):
            rule = RULES.get(f.name)
            if rule is None:
                raise TypeError(f"SparseConfig.{f.name} has no validation rule in backend/config.py RULES")
            object.__setattr__(self, f.name, rule(f.name, getattr(self, f.name)))

    def replace(self, **changes: Any) -> "SparseConfig":
        """A copy with some fields changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(values)
        if unknown:
            raise ValueError(f"SparseConfig has no field(s) {sorted(unknown)}; fields are {sorted(values)}")
        values.update(changes)
        return SparseConfig(**values)
