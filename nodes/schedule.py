"""Which (layer, denoising step) runs sparse.

ComfyUI calls the H3 model once per cond/uncond batch (H3 runs batch size 1, so a CFG step is
two calls). Warmup must count denoising steps, not calls: the step of a call is the entry of the
run's schedule nearest to the call's sigma, ``argmin |sample_sigmas - sigma|``, so both calls of
a CFG pair land on the same step. A changed schedule means a new sampling run.
"""
from __future__ import annotations

import math

import torch

from ..backend.config import SparseConfig


def denoising_step(sigma: torch.Tensor, schedule: torch.Tensor) -> tuple[int, int]:
    """(step, total steps) of a call at `sigma` in `schedule` (steps + 1 sigmas, the last one 0)."""
    sched = schedule.detach().flatten().to("cpu", torch.float64)
    if sched.numel() < 2:
        raise ValueError(f"sample_sigmas must hold at least 2 values (steps + 1), got {sched.numel()}")
    total = sched.numel() - 1
    s = float(sigma.detach().flatten()[0])
    return min(int((sched - s).abs().argmin()), total - 1), total


def warmup_steps(config: SparseConfig, total: int) -> int:
    """Number of leading dense steps: ceil(warmup_ratio * total) for `fidelity`, 0 for `speed`."""
    if config.warmup_mode == "dense":
        return total
    if config.warmup_mode == "speed":
        return 0
    return min(total, math.ceil(round(config.warmup_ratio * total, 9)))


def schedule_reason(config: SparseConfig, layer: int, step: int | None, total: int | None,
                    seq_len: int) -> str | None:
    """Why the schedule keeps (layer, step) dense, or None when it may run sparse."""
    if config.warmup_mode == "dense":
        return "warmup_mode='dense'"
    if step is not None and total is not None and step < warmup_steps(config, total):
        return f"warmup (step {step + 1} of {total})"
    if layer in config.dense_layers:
        return f"layer {layer} is in dense_layers"
    if seq_len < config.min_tokens:
        return f"{seq_len} tokens < min_tokens={config.min_tokens}"
    return None
