"""An error target in place of a fixed ratio (``error_target`` > 0): each block's topk_ratio moves between a
floor and a cap from the error its sparse calls measured at the step before (`ErrorMeter`), so a run holds the
error the user asked for at the density that gives it, block by block.

A run starts every block at ``topk_ratio``. At each new denoising step the latest measured step's errors are read
once from the device (one read a step, not per block); a block whose error is outside the target's band moves its
ratio by the factor error / target (at most 2x a step), on a grid of 0.05 between FLOOR and CAP, so the kernel
choices' classes and the kept plans' budgets stay few; inside the band it stays. A step with no sparse block (a
warmup step, one EasyCache skipped) changes nothing; a run split over sampler calls goes on with its ratios (the
state is the run's); a kept plan is rebuilt when its block's ratio moved (`plan_reuse.PLAN_FIELDS`)."""
from __future__ import annotations

import math

from .error_meter import ErrorMeter

FLOOR, CAP = 0.05, 0.5
GRID = 0.05
BAND = 0.15  # a measured error within 15% of the target leaves the ratio where it is
MAX_FACTOR = 2.0  # the most a ratio moves in one step


class ErrorTarget:
    """One run's ratio per block under an error target."""

    def __init__(self) -> None:
        self.ratios: dict[int, float] = {}
        self.step = -1  # the latest step this run asked for
        self.learned = -1  # the latest measured step whose errors moved the ratios

    def ratio(self, meter: ErrorMeter, layer: int, step: int | None, target: float, start: float) -> float:
        """Block `layer`'s ratio at `step`: learned from the latest measured step before it (read once a step).

        Args:
            meter: the run's measured errors.
            layer: the block index.
            step: the denoising step (None: no learning).
            target: the error to hold (relative L2 of video rows).
            start: the ratio before any measurement (``topk_ratio``).
        """
        if step is not None and step > self.step:
            self.step = step
            found = meter.last_step(before=step, after=self.learned)
            if found is not None:
                self.learned, errors = found
                for block, error in errors.items():
                    self.ratios[block] = moved(self.ratios.get(block, start), error, target)
        return self.ratios.get(layer, start)


def moved(ratio: float, error: float, target: float) -> float:
    """The ratio after a step that measured `error` at `ratio` against `target` (`ErrorTarget`'s rule)."""
    if not math.isfinite(error) or abs(error - target) <= BAND * target:
        return ratio
    factor = min(MAX_FACTOR, max(1.0 / MAX_FACTOR, error / target))
    return min(CAP, max(FLOOR, round(ratio * factor / GRID) * GRID))
