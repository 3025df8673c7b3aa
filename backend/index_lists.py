"""Layer and step indices typed as text ("0, 1, 48-49"): parsed with bounds, named when out of range.

The text's length and every index are bounded before a range is expanded, so a hostile string is
refused in microseconds, and the indices a model does not have are named as compact ranges.
"""
from __future__ import annotations

import re
from typing import Iterable

from ..errors import SparseAttentionError
from .value_checks import kind_of, show

MAX_LAYERS = 1024  # layer indices are below this when the model is unknown (MiniMax-H3 has 50 blocks)
MAX_STEPS = 10_000  # denoising step indices are below this
MAX_LIST_CHARS = 1024  # characters of an index-list widget such as "0-2,49"

_INDEX_PART = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", re.ASCII)


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
        raise SparseAttentionError(f"{field}: {'index' if len(bad) == 1 else 'indices'} {spans(runs_of(bad))} out of range: "
                         f"expected 0-{limit - 1} ({what})")


def parse_layer_list(text: str, field: str, limit: int = MAX_LAYERS,
                     what: str = f"at most {MAX_LAYERS} layers") -> tuple[int, ...]:
    """Parse a widget string such as ``"0, 1, 48-49"`` into sorted unique indices below `limit`.

    Args:
        text: comma-separated ASCII indices or ranges lo-hi (lo <= hi); empty parts are ignored.
        field: the widget or setting named in error messages, e.g. "SparseConfig.dense_layers".
        limit: every index must be below it (the model's layer count, or a fixed maximum).
        what: where `limit` comes from, for the message.
    Returns:
        The sorted unique indices.
    """
    if not isinstance(text, str):
        raise TypeError(f"{field}={show(text)} is not allowed: expected a string such as '0,1,48-49', "
                        f"got {kind_of(text)}")
    if len(text) > MAX_LIST_CHARS:
        raise SparseAttentionError(f"{field}={show(text)} is not allowed: expected at most {MAX_LIST_CHARS} characters")
    ranges = []
    for part in text.split(","):
        if not part.strip():
            continue
        match = _INDEX_PART.fullmatch(part)
        if match is None:
            raise SparseAttentionError(f"{field}={show(text)} is not allowed: {show(part.strip())} is not an index or a range: "
                             "expected comma-separated indices or ranges lo-hi like '0,1,48-49'")
        lo = int(match.group(1))  # at most MAX_LIST_CHARS digits
        hi = lo if match.group(2) is None else int(match.group(2))
        if hi < lo:
            raise SparseAttentionError(f"{field}={show(text)} is not allowed: range {lo}-{hi} has lo > hi: expected ranges "
                             "lo-hi with lo <= hi")
        ranges.append((lo, hi))
    bad = sorted((max(lo, limit), hi) for lo, hi in ranges if hi >= limit)
    if bad:
        raise SparseAttentionError(f"{field}={show(text)} is not allowed: {spans(bad)} out of range: expected indices "
                         f"0-{limit - 1} ({what})")
    return tuple(sorted({i for lo, hi in ranges for i in range(lo, hi + 1)}))
