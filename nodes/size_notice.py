"""Telling the user when a clip is too small for sparse attention to pay (once per run, in the report)."""
from __future__ import annotations

import logging

import torch

from ..backend.config import SparseConfig
from ..kernels.dense.choice import DenseChoices
from ..kernels.dense.pays_from import describe, pays_at, saved
from .run_tracker import RunTracker

MAX_SAID = 64  # messages remembered as said at WARNING; past it they are said at WARNING again


class SizeNotice:
    """The crossover `prepare` measured per (device, dtype), and the messages said at WARNING, shared by the
    clones of one patched model (later runs say them at INFO)."""

    def __init__(self) -> None:
        self.pays_from: dict[tuple, str | None] = {}
        self.said: set[str] = set()

    def note(self, tokens: int, dtype: torch.dtype, device: torch.device, config: SparseConfig,
             choices: DenseChoices, tracker: RunTracker) -> None:
        """Say once per run, at WARNING and in the report, when `tokens` is too small for sparse attention to
        pay: below min_tokens (it runs dense), or below the crossover measured on this GPU (it runs sparse,
        slower than dense); either with that crossover, or that it is not measured."""
        key = (str(device), dtype)
        if key not in self.pays_from:
            self.pays_from[key] = saved(choices, device, dtype, config)
        value = self.pays_from[key]
        pays = pays_at(value, tokens)
        if tokens < config.min_tokens:
            hint = f"; lower min_tokens to {int(value):,} to run it sparse" if pays else ""
            message = (f"{tokens:,} tokens is below min_tokens={config.min_tokens:,}, so attention runs dense at "
                       f"this size; {describe(value)}{hint}")
        elif pays is False:
            raise_to = f" (raise min_tokens to {int(value):,} to run such sizes dense)" if value.isdigit() else ""
            message = f"{tokens:,} tokens is too small for sparse attention to pay; {describe(value)}{raise_to}"
        else:
            return
        if len(self.said) >= MAX_SAID:
            self.said.clear()
        first = message not in self.said
        self.said.add(message)
        tracker.say_in_report(message, logging.WARNING if first else logging.INFO)
