"""Which (layer, denoising step) runs sparse: the warmup rule, and the other reasons to run dense.

Warmup follows the model's sigma schedule, as ComfyUI's own step-range settings do
(``model_sampling.percent_to_sigma``): in `fidelity` mode a model call runs dense while its sigma
is above the sigma at ``warmup_ratio`` of the denoising (`warmup_reason`). A sampler call that
runs only part of the schedule (KSamplerAdvanced's start/end steps, SplitSigmas) therefore runs
exactly the dense steps the whole schedule would. With ComfyUI's "simple" scheduler (sigmas
spaced evenly in the model's time) that is the first ``ceil(warmup_ratio * steps)`` steps
(`warmup_steps`); other schedulers differ. Without the model's sampling object (a sampler that never ran the
model's ON_PRE_RUN callbacks) the rule falls back to counting the steps of the call's own schedule.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..backend.config import SparseConfig

SIGMA_RTOL = 1e-4  # a sigma this close to the warmup sigma is not above it (float32 schedules)


def denoising_step(sigma: torch.Tensor, schedule: torch.Tensor) -> tuple[int, int]:
    """(step, total steps) of a call at `sigma` in `schedule` (steps + 1 sigmas, the last one 0)."""
    sched = schedule.detach().flatten().to("cpu", torch.float64)
    if sched.numel() < 2:
        raise ValueError(f"sample_sigmas must hold at least 2 values (steps + 1), got {sched.numel()}")
    total = sched.numel() - 1
    s = float(sigma.detach().flatten()[0])
    return min(int((sched - s).abs().argmin()), total - 1), total


def warmup_steps(config: SparseConfig, total: int) -> int:
    """Number of leading dense steps of `total` evenly spaced ones: ceil(warmup_ratio * total) for
    `fidelity`, 0 for `speed`, all for `dense`."""
    if config.warmup_mode == "dense":
        return total
    if config.warmup_mode == "speed":
        return 0
    return min(total, math.ceil(round(config.warmup_ratio * total, 9)))


def warmup_sigma(config: SparseConfig, percent_to_sigma: Callable[[float], Any]) -> float:
    """The sigma at ``warmup_ratio`` of the denoising, from the model's ``percent_to_sigma``."""
    return float(percent_to_sigma(config.warmup_ratio))


def warmup_reason(config: SparseConfig, sigma: float | None, threshold: float | None,
                  segment: tuple[int, int] | None) -> str | None:
    """Why a model call at `sigma` is a warmup step, or None.

    Args:
        config: the node's settings (only `fidelity` mode has a warmup).
        sigma: the call's sigma (None: unknown, no warmup applies).
        threshold: `warmup_sigma` of the model, or None when the model's sampling is unknown;
            a call is a warmup call when its sigma is above it (beyond float rounding).
        segment: (step, total) in the call's own schedule: the rule without a threshold.
    """
    if config.warmup_mode != "fidelity" or sigma is None:
        return None
    if threshold is not None:
        if sigma > threshold * (1.0 + SIGMA_RTOL):
            return f"warmup (sigma above {threshold:.4g}, the sigma at warmup_ratio={config.warmup_ratio:g})"
        return None
    if segment is not None and segment[0] < warmup_steps(config, segment[1]):
        return f"warmup (step {segment[0] + 1} of {segment[1]})"
    return None


def schedule_reason(config: SparseConfig, layer: int, warmup: str | None, seq_len: int) -> str | None:
    """Why the schedule keeps a block call dense, or None when it may run sparse.

    Args:
        config: the node's settings.
        layer: the block index.
        warmup: `warmup_reason` of the call (None: not a warmup step).
        seq_len: the call's rows.
    """
    if config.warmup_mode == "dense":
        return "warmup_mode='dense'"
    if warmup is not None:
        return warmup
    if layer in config.dense_layers:
        return f"layer {layer} is in dense_layers"
    if seq_len < config.min_tokens:
        return f"{seq_len} tokens < min_tokens={config.min_tokens}"
    return None
