"""The kinds of value a setting accepts, each as data (its bounds or choices) with its check.

A rule's bounds are plain attributes, so whatever shows a setting to a user (the node's widgets)
reads them from the rule instead of copying them. `check` returns the value normalised to the
setting's type (a NumPy scalar becomes a Python one) or raises ValueError naming the setting, the
value and what is allowed.
"""
from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass
from typing import Any, Union

from .index_lists import MAX_LAYERS, check_indices, parse_layer_list
from .value_checks import as_index, is_bool, is_scalar, kind_of, refusal, show


@dataclass(frozen=True)
class Number:
    """A real number in [lo, hi] (int, float, NumPy scalar; not a bool), normalised to float."""

    lo: float
    hi: float

    @property
    def allowed(self) -> str:
        """What the rule accepts, as error messages say it."""
        return f"a number in [{self.lo}, {self.hi}]"

    def check(self, name: str, value: Any) -> float:
        """`value` as a float, or ValueError naming `name`."""
        if is_bool(value) or not isinstance(value, numbers.Real):
            raise refusal(name, value, f"{self.allowed}, got {kind_of(value)}")
        if not self.lo <= value <= self.hi:  # NaN fails too; compared before float() so a huge int cannot overflow
            raise refusal(name, value, self.allowed)
        return float(value)


@dataclass(frozen=True)
class Integer:
    """An integer in [lo, hi], normalised to int."""

    lo: int
    hi: int

    @property
    def allowed(self) -> str:
        """What the rule accepts, as error messages say it."""
        return f"an integer in [{self.lo}, {self.hi}]"

    def check(self, name: str, value: Any) -> int:
        """`value` as an int, or ValueError naming `name`."""
        return as_index(name, value, self.lo, self.hi, self.allowed)


@dataclass(frozen=True)
class Choice:
    """One of `choices` (all str or all int), normalised to the choices' type."""

    choices: tuple[Any, ...]

    @property
    def allowed(self) -> str:
        """What the rule accepts, as error messages say it."""
        return "one of " + ", ".join(repr(c) for c in self.choices)

    def check(self, name: str, value: Any) -> Any:
        """`value` as one of the choices, or ValueError naming `name`."""
        if isinstance(self.choices[0], int):
            i = as_index(name, value, min(self.choices), max(self.choices), self.allowed)
            if i not in self.choices:
                raise refusal(name, value, self.allowed)
            return i
        if not isinstance(value, str):
            raise refusal(name, value, f"{self.allowed}, got {kind_of(value)}")
        if value not in self.choices:
            raise refusal(name, value, self.allowed)
        return str(value)


@dataclass(frozen=True)
class Flag:
    """True or False: a bool scalar of any kind (0 and 1 are not flags)."""

    @property
    def allowed(self) -> str:
        """What the rule accepts, as error messages say it."""
        return "True or False"

    def check(self, name: str, value: Any) -> bool:
        """`value` as a bool, or ValueError naming `name`."""
        if not is_bool(value) or not is_scalar(value):
            raise refusal(name, value, f"{self.allowed}, got {kind_of(value)}")
        return bool(value)


@dataclass(frozen=True)
class LayerIndices:
    """Layer indices below `limit` from a widget string such as '0-2,49' or a tuple/list/set/range
    of integers, normalised to a sorted tuple of unique ints."""

    limit: int = MAX_LAYERS

    @property
    def allowed(self) -> str:
        """What the rule accepts, as error messages say it."""
        return f"a tuple of non-negative layer indices below {self.limit} or a string such as '0-2,49'"

    def check(self, name: str, value: Any) -> tuple[int, ...]:
        """`value` as sorted unique layer indices, or ValueError naming `name`."""
        what = f"at most {self.limit} layers"
        if isinstance(value, str):
            return parse_layer_list(value, name, self.limit, what)
        if not isinstance(value, (tuple, list, range, set, frozenset)):
            raise refusal(name, value, f"{self.allowed}, got {kind_of(value)}")
        if len(value) > self.limit:
            raise refusal(name, value, f"{self.allowed}, at most {self.limit} of them")
        indices = set()
        for item in value:
            try:
                i = None if is_bool(item) or isinstance(item, float) else operator.index(item)
            except TypeError:
                i = None
            if i is None or i < 0:
                raise refusal(name, value, f"{self.allowed}; {show(item)} is not one")
            indices.add(i)
        result = tuple(sorted(indices))
        check_indices(result, name, self.limit, what)
        return result


Rule = Union[Number, Integer, Choice, Flag, LayerIndices]
