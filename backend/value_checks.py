"""Telling a setting's value apart and refusing it: the pieces every rule of the config shares.

A value may come from a workflow, a script or NumPy/torch code, so a bool is recognised in any of
those forms, an integer is taken only when it really is one, and a refused value is echoed in
bounded form so an error message never repeats (or builds) a huge input.
"""
from __future__ import annotations

import operator
from typing import Any

from ..errors import SparseAttentionError

SHOWN_CHARS = 60  # characters of a bad value quoted in an error message


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


def refusal(name: str, value: Any, allowed: str) -> SparseAttentionError:
    """The error for a value `name` does not accept: it names the setting, the value and what is allowed.

    Args:
        name: the setting as the user knows it, e.g. "SparseConfig.topk_ratio".
        value: the refused value (shown bounded).
        allowed: what the setting accepts, e.g. "a number in [0.01, 1.0]".
    Returns:
        The error to raise (a ValueError).
    """
    return SparseAttentionError(f"{name}={show(value)} is not allowed: expected {allowed}")


def is_bool(value: Any) -> bool:
    """Any kind of bool: Python's, NumPy's, a bool tensor or array (told by type and dtype, so
    NumPy need not be imported)."""
    t = type(value)
    return (isinstance(value, bool) or (t.__module__ == "numpy" and t.__name__ in ("bool", "bool_"))
            or str(getattr(value, "dtype", "")) in ("torch.bool", "bool"))


def is_scalar(value: Any) -> bool:
    """Whether `value` has no dimensions (plain Python values, NumPy scalars, 0-d tensors)."""
    return tuple(getattr(value, "shape", ())) == ()


def kind_of(value: Any) -> str:
    """The type name an error message gives for `value` ("bool" for a bool scalar of any kind)."""
    return "bool" if is_bool(value) and is_scalar(value) else type(value).__name__


def as_index(name: str, value: Any, lo: int, hi: int, allowed: str) -> int:
    """`value` as an int in [lo, hi]: ints, NumPy integers and one-element integer tensors pass;
    bools and floats do not (a float where an integer is meant is a mistake, not a rounding).

    Args:
        name: the setting, for the message.
        value: the value to check.
        lo, hi: the inclusive bounds.
        allowed: what the setting accepts, for the message.
    Returns:
        The value as a plain int.
    """
    if is_bool(value) or isinstance(value, float):
        raise refusal(name, value, f"{allowed}, got {kind_of(value)}")
    try:
        i = operator.index(value)
    except TypeError:
        raise refusal(name, value, f"{allowed}, got {kind_of(value)}") from None
    if not lo <= i <= hi:
        raise refusal(name, value, allowed)
    return int(i)
