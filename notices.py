"""The pack's logger, and notices said once per owner (strict mode raises instead).

A fallback or refusal that holds for every call (a kernel that cannot run, a stage that cannot take
its inputs, a layer that runs dense) is logged once per owner (a layout, a sampling run, a dense
chooser), not once per call; under ``strict`` it raises instead.
"""
from __future__ import annotations

import logging

NAME = "adaptive_sparse_attention"


def logger() -> logging.Logger:
    """The pack's logger (named for the package, so a host application can configure it)."""
    return logging.getLogger(NAME)


class Notices:
    """An owner's once-only record of what was said; `limit` bounds how many distinct messages are
    remembered (None: all; an owner that lives as long as the process should set one)."""

    def __init__(self, limit: int | None = None) -> None:
        self.said: set[str] = set()
        self.limit = limit

    def __len__(self) -> int:
        return len(self.said)

    def clear(self) -> None:
        """Forget what was said (it will be said again)."""
        self.said.clear()

    def say(self, message: str, level: int = logging.WARNING) -> None:
        """Log `message` at `level` unless this owner said it before."""
        if self._first(message):
            logger().log(level, "%s", message)

    def fallback(self, message: str, instead: str | None, strict: bool) -> None:
        """`message` says what cannot run: raise RuntimeError in strict mode, else say it once, with
        what runs `instead` (None: the message says it)."""
        if strict:
            raise RuntimeError(f"{message} (strict mode)")
        if self._first(message):
            logger().warning("%s", message if instead is None else f"{message}; {instead}")

    def _first(self, message: str) -> bool:
        """Whether `message` was not said before; remembers it (within `limit`)."""
        if message in self.said:
            return False
        if self.limit is None or len(self.said) < self.limit:
            self.said.add(message)
        return True
