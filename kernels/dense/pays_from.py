"""From which token count sparse attention pays on a GPU: the figure `prepare` measures and saves.

`prepare` times the sparse op at the node's settings against the dense kernel our node would run
instead (the dense choice) on a ladder of H3 clip lengths, and saves the smallest token count from
which sparse is faster at it and every longer rung (`crossover`). It lives in the dense choices'
file, under a key naming the GPU and build (`DenseChoices.describe_device`), the dtype and the
settings the time depends on; the node reads it (`saved`) to say from which size sparse attention
pays when a run is too small. Nothing here is a fixed figure: without a measurement the node says so.
"""
from __future__ import annotations

from typing import Any

import torch

from ...errors import SparseAttentionError
from .choice import DenseChoices

PREFIX = "sparse pays from"


def pays_from_key(device_label: str, dtype: torch.dtype, config: Any) -> str:
    """The entry's key: GPU and build, dtype and the settings the sparse time depends on.

    Args:
        device_label: `DenseChoices.describe_device` of the device.
        dtype: the attention's dtype.
        config: the node's `SparseConfig` (ratio, tiling, tail, block size, kernel, precision).
    Returns:
        The key in the choices' file.
    """
    return (f"{PREFIX}|{device_label}|{dtype}|ratio {config.topk_ratio:g}|tiling {config.tiling}|tail {config.tail}"
            f"|block {config.block_size}|kernel {config.kernel}|precision {config.precision}")


def crossover(timings: list[tuple[int, float, float]]) -> str:
    """The saved value of a ladder of (tokens, sparse ms, dense ms): the smallest token count from
    which sparse is faster at every longer rung too, or ">N" when it is not faster even at the
    longest rung N.

    Raises:
        ValueError: an empty ladder.
    """
    if not timings:
        raise SparseAttentionError("crossover: no timings")
    rungs = sorted(timings)
    pays = None
    for tokens, sparse_ms, dense_ms in reversed(rungs):
        if sparse_ms >= dense_ms:
            break
        pays = tokens
    return f">{rungs[-1][0]}" if pays is None else str(pays)


def saved(choices: DenseChoices, device: torch.device, dtype: torch.dtype, config: Any) -> str | None:
    """The saved value for this GPU, dtype and settings (`crossover`), or None when not measured."""
    value = choices.file.read().get(pays_from_key(choices.describe_device(device), dtype, config))
    if value is None or not value.lstrip(">").isdigit():
        return None
    return value


def describe(value: str | None) -> str:
    """The node's words for a saved value."""
    if value is None:
        return ("from which size sparse attention pays on this GPU is not measured yet at these settings "
                "(`python -m adaptive_sparse_attention prepare` measures it at the node's default settings)")
    if value.startswith(">"):
        return (f"on this GPU sparse attention was slower than dense at every length `prepare` measured, up to "
                f"{int(value[1:]):,} tokens")
    return f"on this GPU sparse attention pays from {int(value):,} tokens (measured by `prepare` at these settings)"


def pays_at(value: str | None, tokens: int) -> bool | None:
    """Whether a saved value says sparse pays at `tokens` (None: not measured there)."""
    if value is None:
        return None
    if value.startswith(">"):
        return False if tokens <= int(value[1:]) else None
    return tokens >= int(value)
