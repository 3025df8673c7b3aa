"""`SparseConfig`: every widget of the node, validated in one place.

The node translates its widgets into this object one to one; tests, the benchmark and users
build it directly. A bad value raises `ValueError` naming the field, the value and what is
allowed, so a mistyped workflow fails loudly instead of silently running something else.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

WARMUP_MODES = ("fidelity", "speed", "dense")
SPARSE_SCOPES = ("target-video", "joint-video")
TAIL_GRANULARITIES = ("query", "block")
TILINGS = ("reblock", "cube")
REBLOCK_LAYOUTS = ("q_reuse_k", "independent")
TAILS = ("reweight", "mean", "none", "coarse")
BLOCK_SIZES = (64, 128)
BACKENDS = ("auto", "triton", "torch")
DENSE_ATTENTIONS = ("fastest", "comfyui")
ROUTING_SCORES = ("fp32", "int8", "fp8")


def _fail(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"SparseConfig.{field}={value!r} is not allowed: expected {allowed}")


def parse_layer_list(text: str, field: str = "SparseConfig.dense_layers") -> tuple[int, ...]:
    """Parse a widget string such as ``"0, 1, 48-49"`` into sorted unique indices.

    `field` names the widget in error messages (the capture node parses layers and steps too).
    """
    layers: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"{field}={text!r} is not allowed: expected comma-separated indices or ranges "
                             "like '0,1,48-49'") from None
        if a < 0 or b < a:
            raise ValueError(f"{field}={text!r} is not allowed: expected non-negative indices and ranges lo-hi "
                             "with lo <= hi")
        layers.update(range(a, b + 1))
    return tuple(sorted(layers))


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
        (default: at 10% it halves the output error of cube tiling on the H3 scenes for ~15% more
        time at 10 s, BENCHMARKS.md) or fixed 3D cubes.
    tail: what stands in for unselected candidate blocks.
    dense_layers: layer indices that always run dense; min_tokens: shorter sequences run dense.
    block_size: tokens per block (64 or 128). strict: raise instead of falling back to dense.
    backend: `auto` (Triton on CUDA, torch otherwise), `triton` or `torch`.
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
        if isinstance(self.dense_layers, str):
            object.__setattr__(self, "dense_layers", parse_layer_list(self.dense_layers))
        self._check_number("topk_ratio", 0.01, 1.0)
        self._check_number("warmup_ratio", 0.0, 1.0)
        for name, choices in (
            ("warmup_mode", WARMUP_MODES),
            ("sparse_scope", SPARSE_SCOPES),
            ("tail_granularity", TAIL_GRANULARITIES),
            ("tiling", TILINGS),
            ("reblock_layout", REBLOCK_LAYOUTS),
            ("tail", TAILS),
            ("backend", BACKENDS),
            ("dense_attention", DENSE_ATTENTIONS),
            ("routing_scores", ROUTING_SCORES),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise _fail(name, value, "one of " + ", ".join(repr(c) for c in choices))
        if self.block_size not in BLOCK_SIZES or isinstance(self.block_size, bool):
            raise _fail("block_size", self.block_size, "64 or 128")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise _fail("min_tokens", self.min_tokens, "an integer >= 0")
        if not isinstance(self.strict, bool):
            raise _fail("strict", self.strict, "True or False")
        layers = self.dense_layers
        if not isinstance(layers, tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
        ):
            raise _fail("dense_layers", layers, "a tuple of non-negative layer indices")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(layers))))

    def _check_number(self, name: str, lo: float, hi: float) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise _fail(name, value, f"a number in [{lo}, {hi}]")
        object.__setattr__(self, name, float(value))

    def replace(self, **changes: Any) -> "SparseConfig":
        """A copy with some fields changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(values)
        if unknown:
            raise ValueError(f"SparseConfig has no field(s) {sorted(unknown)}; fields are {sorted(values)}")
        values.update(changes)
        return SparseConfig(**values)
