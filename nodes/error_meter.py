"""The measured error of a run's sparse calls: the sums of the sampled exact rows (`backend/fidelity.py`), added up
on the device per denoising step and block, each with the ratio its calls ran at, and read back once when the
run's report is made, or once a step for an error target (no host synchronisation in the per-block path)."""
from __future__ import annotations

import math
from typing import Callable

import torch

# What the number means: the relative L2 error of video rows against dense attention measured on the bench
# scenes (BENCHMARKS.md, REFERENCE): comfy-kitchen's INT8 dense attention (ComfyUI --use-ck-attention) and
# ComfyUI's core sparse node at its default (sol-attn, tau 1.3) at 10 s.
SCALE = ("for scale: comfy-kitchen's INT8 dense attention 0.017 (random inputs); ComfyUI's core sparse node at its "
         "default 0.06-0.21 (bench scenes at 10 s)")


def relative(sums: torch.Tensor) -> torch.Tensor:
    """sqrt(sum diff^2 / sum exact^2) over the last-but-one axis of [..., 2, n] sums, per last index."""
    return (sums[..., 0, :] / sums[..., 1, :].clamp_min(torch.finfo(sums.dtype).tiny)).sqrt()


class ErrorMeter:
    """One run's sampled error sums: (step, block) -> [2, heads] (sum diff^2, sum exact^2) on the device, and the
    topk_ratio those calls ran at."""

    def __init__(self) -> None:
        self.sums: dict[tuple[int, int], torch.Tensor] = {}
        self.ratios: dict[tuple[int, int], float] = {}  # NaN where the calls of a (step, block) ran at several

    def sink(self, step: int | None, layer: int, h0: int, heads: int,
             ratio: float = math.nan) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """The `error_sink` of one sparse call: adds its per-head sums at heads h0.. of block `layer`, `step`.

        Args:
            step: the denoising step (None: -1).
            layer: the block index.
            h0: the call's first head (KJNodes' head groups call once per group).
            heads: the block's heads.
            ratio: the topk_ratio the call ran at (NaN: not known; an error target learns nothing from it).
        """
        key = (-1 if step is None else step, layer)
        if self.ratios.setdefault(key, ratio) != ratio:  # NaN stays NaN
            self.ratios[key] = math.nan

        def add(sq_diff: torch.Tensor, sq_exact: torch.Tensor) -> None:
            acc = self.sums.get(key)
            if acc is None:
                acc = self.sums[key] = sq_diff.new_zeros(2, heads, dtype=torch.float64)
            acc[0, h0:h0 + sq_diff.shape[0]] += sq_diff
            acc[1, h0:h0 + sq_exact.shape[0]] += sq_exact

        return add

    def summary(self) -> dict | None:
        """The run's measured error (one read from the device), or None when nothing was measured:
        ``mean`` over every sampled row of the run, ``steps`` {step: error}, ``worst_block`` (block, error),
        ``worst_head`` (block, head, error), each a relative L2 of video rows against dense attention."""
        if not self.sums:
            return None
        keys = sorted(self.sums)
        sums = torch.stack([self.sums[k] for k in keys]).cpu()  # [K, 2, H]
        steps = sorted({s for s, _ in keys})
        layers = sorted({b for _, b in keys})
        per_step = {s: float(relative(sums[[i for i, k in enumerate(keys) if k[0] == s]].sum((0, 2))[..., None])[0])
                    for s in steps}
        per_layer = torch.stack([sums[[i for i, k in enumerate(keys) if k[1] == b]].sum(0) for b in layers])  # [L, 2, H]
        blocks = relative(per_layer.sum(-1, keepdim=True))[:, 0]
        heads = relative(per_layer)  # [L, H]
        worst = int(heads.flatten().argmax())
        b = int(blocks.argmax())
        return {"mean": float(relative(sums.sum((0, 2))[..., None])[0]), "steps": per_step,
                "worst_block": (layers[b], float(blocks[b])),
                "worst_head": (layers[worst // heads.shape[1]], worst % heads.shape[1], float(heads.flatten()[worst]))}

    def last_step(self, before: int, after: int) -> tuple[int, dict[int, tuple[float, float]]] | None:
        """(step, {block: (ratio, error)}) of the latest step measured in (after, before), read from the device
        once; None when no step in that range ran sparse blocks (a dense or skipped step)."""
        steps = [s for s, _ in self.sums if after < s < before]
        if not steps:
            return None
        step = max(steps)
        layers = sorted(b for s, b in self.sums if s == step)
        sums = torch.stack([self.sums[(step, b)] for b in layers]).sum(-1, keepdim=True).cpu()  # [L, 2, 1]
        return step, {b: (self.ratios[(step, b)], e) for b, e in zip(layers, relative(sums)[:, 0].tolist())}

