"""Which (layer, denoising step) runs sparse: the warmup rule, and the other reasons to run dense.

Warmup follows the model's sigma schedule, as ComfyUI's own step-range settings do
(``model_sampling.percent_to_sigma``): in `fidelity` mode a model call runs dense while its sigma
is above the sigma at ``warmup_ratio`` of the denoising (`warmup_reason`). A sampler call that
runs only part of the schedule (KSamplerAdvanced's start/end steps, SplitSigmas) therefore runs
exactly the dense steps the whole schedule would. With ComfyUI's "simple" scheduler (sigmas
spaced evenly in the model's time) that is the first ``ceil(warmup_ratio * steps)`` steps
(`warmup_steps`); other schedulers differ. Without the model's sampling object (a sampler that never ran the
model's ON_PRE_RUN callbacks) the rule falls back to counting the steps of the call's own schedule.

In `ramp` mode the same span runs at falling density instead of dense (`ramp_ratio`): with r the
topk_ratio, s_w the warmup sigma and s_0 the model's start sigma (its ``sigma_max``: the first sigma
of a full schedule), a call at sigma s runs at density
    1                                      for s >= s_0 (the first step of a full schedule: dense),
    r + (1 - r) * (s - s_w) / (s_0 - s_w)  for s_w < s < s_0 (linear in sigma),
    r                                      for s <= s_w (the sparse steps, as in fidelity mode),
with the same float tolerance as the warmup rule. It depends on the call's sigma and the model's
sampling only, so split sampler runs and EasyCache-skipped steps leave every other step's density
as in the whole run. Without the model's sampling it is linear in the call's own step index:
1 - (1 - r) * step / n over the n = ceil(warmup_ratio * steps) warmup steps.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..errors import SparseAttentionError
from ..backend.config import SparseConfig

SIGMA_RTOL = 1e-4  # a sigma this close to the warmup sigma is not above it (float32 schedules)


def denoising_step(sigma: torch.Tensor, schedule: torch.Tensor) -> tuple[int, int]:
    """(step, total steps) of a call at `sigma` in `schedule` (steps + 1 sigmas, the last one 0)."""
    sched = schedule.detach().flatten().to("cpu", torch.float64)
    if sched.numel() < 2:
        raise SparseAttentionError(f"sample_sigmas must hold at least 2 values (steps + 1), got {sched.numel()}")
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
    return min(total, math.ceil(round(config.warmup_ratio * total, 9)))  # fidelity (and ramp's span)


def warmup_sigma(config: SparseConfig, percent_to_sigma: Callable[[float], Any]) -> float:
    """The sigma at ``warmup_ratio`` of the denoising, from the model's ``percent_to_sigma``."""
    return float(percent_to_sigma(config.warmup_ratio))


def start_sigma(sampling: Any) -> float:
    """The sigma a full schedule of the model starts at: its sampling's ``sigma_max`` (1.0 for flow
    models such as H3), else ``percent_to_sigma(0)``."""
    top = getattr(sampling, "sigma_max", None)
    return float(sampling.percent_to_sigma(0.0) if top is None else top)


def ramp_ratio(config: SparseConfig, sigma: float | None, threshold: float | None, start: float | None,
               segment: tuple[int, int] | None) -> float:
    """The density a model call runs at: `config.topk_ratio`, or in `ramp` mode the ramp of the module
    docstring (1.0: the call runs dense).

    Args:
        config: the node's settings.
        sigma: the call's sigma (None: unknown, the ramp does not apply).
        threshold: `warmup_sigma` of the model (None: unknown, the step-count rule applies).
        start: `start_sigma` of the model (None likewise).
        segment: (step, total) in the call's own schedule: the rule without the model's sigmas.
    Returns:
        A density in [topk_ratio, 1].
    """
    r = config.topk_ratio
    if config.warmup_mode != "ramp" or sigma is None:
        return r
    if threshold is not None and start is not None:
        if sigma <= threshold * (1.0 + SIGMA_RTOL):
            return r
        if sigma >= start * (1.0 - SIGMA_RTOL) or start <= threshold:
            return 1.0
        return min(1.0, r + (1.0 - r) * (sigma - threshold) / (start - threshold))
    if segment is None:
        return r
    n = warmup_steps(config, segment[1])
    return r if segment[0] >= n else 1.0 - (1.0 - r) * segment[0] / n


def warmup_reason(config: SparseConfig, sigma: float | None, threshold: float | None,
                  segment: tuple[int, int] | None, start: float | None = None) -> str | None:
    """Why a model call at `sigma` is a warmup step that runs dense, or None.

    Args:
        config: the node's settings (`fidelity` mode has a dense warmup; `ramp` mode runs dense
            where `ramp_ratio` is 1).
        sigma: the call's sigma (None: unknown, no warmup applies).
        threshold: `warmup_sigma` of the model, or None when the model's sampling is unknown;
            a call is a warmup call when its sigma is above it (beyond float rounding).
        segment: (step, total) in the call's own schedule: the rule without a threshold.
        start: `start_sigma` of the model (ramp mode).
    """
    if config.warmup_mode == "ramp":
        if config.topk_ratio >= 1.0 or ramp_ratio(config, sigma, threshold, start, segment) < 1.0:
            return None  # topk_ratio 1.0: every call is exact on the sparse path, as in the other modes
        return f"warmup (ramp: dense at sigma {sigma:.4g}, the start of the schedule)"
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
