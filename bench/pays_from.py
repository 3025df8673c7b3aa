"""Measure from which token count sparse attention pays on this GPU (run by `prepare`).

A ladder of H3 clip lengths at 1344x768 (24 x 42 latent rows a frame, 56 heads of 128, text 256
rows, about 11.25 audio rows a latent frame as H3 packs them): at each rung the sparse op at the
node's settings is timed against the dense kernel our node runs in its place (the dense choice,
measured and saved as the node would), on the same strided q/k/v. The crossover is saved with the
dense choices (kernels/dense/pays_from.py) for the node to read.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..backend.attention import sparse_attention
from ..backend.config import SparseConfig
from ..kernels.dense.choice import DenseChoices
from ..kernels.dense.pays_from import crossover, pays_from_key
from ..timer import median_ms
from .scenes import SceneSize, strided_qkv

LADDER = (2, 4, 7, 12, 17, 24, 37)  # latent frames: about 2,300 to 38,000 tokens


def ladder(frames: tuple[int, ...] = LADDER, grid: tuple[int, int] = (24, 42), heads: int = 56,
           head_dim: int = 128, text: int = 256) -> list[SceneSize]:
    """H3 clip shapes of `frames` latent frames each."""
    return [SceneSize(text, round(11.25 * t), (t, *grid), heads, head_dim) for t in frames]


def measure(sizes: list[SceneSize], device: torch.device, dtype: torch.dtype, config: SparseConfig,
            choices: DenseChoices, echo: Callable[[str], object] = print, reps: int = 3) -> tuple[str, list]:
    """Time sparse against dense on each size and save the crossover.

    Args:
        sizes: the ladder (`ladder`).
        device: where to time.
        dtype: the model's compute dtype.
        config: the node's settings (their sparse op is timed).
        choices: the dense choices (their kernel is timed; the crossover is saved in their file).
        echo: prints one line per rung.
        reps: timed calls per kernel and rung (after one warm-up call).
    Returns:
        (the saved value, [(tokens, sparse ms, dense ms)]).
    """
    timings = []
    for size in sizes:
        q, k, v = strided_qkv(size.total, size.heads, size.head_dim, dtype, device)
        layout = size.layout()
        sparse_ms = median_ms(lambda: sparse_attention(q, k, v, layout, config), device, reps=reps)
        dense_ms = median_ms(lambda: choices.attention(q, k, v, precision=config.precision
                                                       if config.precision != "auto" else "bf16"), device, reps=reps)
        timings.append((size.total, sparse_ms, dense_ms))
        echo(f"prepare: {size.total:,} tokens: sparse {sparse_ms:.2f} ms, dense {dense_ms:.2f} ms")
        del q, k, v
    value = crossover(timings)
    choices.file.save(pays_from_key(choices.describe_device(device), dtype, config), value)
    return value, timings
