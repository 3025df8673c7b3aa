"""An error target in place of a fixed ratio (``error_target`` > 0): each block's topk_ratio moves between FLOOR
and CAP until the error its sparse calls measure (`ErrorMeter`) is within BAND of the target, then stays.

A run starts every block at ``topk_ratio``. At each new denoising step the latest measured step's errors are read
once from the device (one read a step, not per block), each with the ratio it was measured at, and each block's
`Course` learns from its own:
- only a measurement at the ratio the course gave the block is learned from: a ramp step's, at the ramp's
  density, teaches nothing;
- the slope of log error against log ratio is the weighted least-squares slope of the block's last MEMORY
  measurements (each FORGET times the weight of the next newer one), bounded to SLOPES; until two distinct
  ratios are measured it is the steepest allowed, so the first step cannot overshoot;
- the error at the block's ratio is a smoothed estimate: the measurements' weighted mean, each carried to that
  ratio along the slope (one step's noise moves it by about a third of that noise, once a few are kept);
- within BAND of the target the ratio stays; outside, it steps toward the target in log space, DAMPING of the
  way the slope says (at most MAX_FACTOR a step), onto the grid. A ratio that moved goes on until its estimate
  is within AIM (half the band; between AIM and BAND one grid ratio a step, taken only where the slope says it
  comes nearer), so noise does not leave it at the band's edge;
- the bracket: the last ratio left with its error above the target and the last left below it; once both
  exist a step stays strictly inside (one that would leave goes to the geometric middle instead), so no ratio
  is visited twice. Where no grid ratio lies inside, the ratio stays, unless the slope says the other end is
  out of the band on the same side (the errors drifted along the schedule): that end is dropped.
The grid is geometric, FLOOR * 2^(k / GRID) up to CAP, so a run uses few distinct ratios (the kernel choices'
classes and the kept plans' budgets stay few); one grid step moves an error of slope 3 by 1.35x at most, within
the band's width (1.15 / 0.85), so every reachable target has a grid ratio inside its band. A target beyond
reach holds the block at FLOOR or CAP. A step with no sparse block (a warmup step, one EasyCache skipped)
changes nothing; a run split over sampler calls goes on with its courses (the state is the run's); a kept plan
is rebuilt when its block's ratio moved (`plan_reuse.PLAN_FIELDS`)."""
from __future__ import annotations

import math

from ..backend.config import TARGET_RATIOS
from .error_meter import ErrorMeter

FLOOR, CAP = TARGET_RATIOS
GRID = 7  # grid ratios per doubling: 2^(1/7) = 1.104 apart
BAND = 0.15  # an estimated error within 15% of the target leaves the ratio where it is
AIM = BAND / 2  # where a moving ratio stops (nearer the target than BAND, so noise does not leave it at an edge)
SLOPES = (0.3, 3.0)  # the bounds of the learned slope (d log error / d log ratio, negated)
DAMPING = 0.9  # the share of the way to the target, as the slope predicts it, one step goes
MAX_FACTOR = 2.0  # the most a ratio moves in one step
MEMORY = 6  # measurements kept per block
FORGET = 0.7  # a measurement's weight against the next newer one's

_STEP = math.log(2.0) / GRID  # one grid step in log ratio
_TOP = math.ceil(math.log(CAP / FLOOR) / _STEP - 1e-9)  # the grid index of CAP
_EPS = 1e-6  # grid positions closer than this are the same ratio


def grid_ratio(index: int) -> float:
    """The grid's ratio at `index` (0: FLOOR; the last: CAP)."""
    return CAP if index >= _TOP else FLOOR * 2.0 ** (index / GRID)


def grid_position(ratio: float) -> float:
    """Where `ratio` lies on the grid, as a (fractional) index."""
    return math.log(ratio / FLOOR) / _STEP


class Course:
    """One block's ratio under an error target: its measurements, learned slope and bracket (module docstring).

    Args:
        start: the ratio before any measurement (``topk_ratio``).
    """

    def __init__(self, start: float) -> None:
        self.ratio = start
        self.seen: list[tuple[float, float]] = []  # (log ratio, log error) of the learned measurements, oldest first
        self.slope = SLOPES[1]
        self.low: float | None = None  # the last ratio left with its error above the target
        self.high: float | None = None  # the last ratio left with its error below the target
        self.moving = False  # the last measurement moved the ratio: it stops within AIM, not BAND

    def learn(self, ratio: float, error: float, target: float) -> None:
        """Take one measured `error` of the block's calls at `ratio` and set the next ratio (`self.ratio`).

        Args:
            ratio: the ratio the calls ran at (a measurement at any other than `self.ratio` is not learned from).
            error: their measured error (relative L2 of video rows; a non-finite one is not learned from).
            target: the error to hold.
        """
        if not (math.isfinite(error) and math.isclose(ratio, self.ratio, rel_tol=1e-9)):
            return
        self.seen = (self.seen + [(math.log(ratio), math.log(max(error, 1e-12)))])[-MEMORY:]
        self.slope = self.fitted_slope()
        gap = self.estimate() - math.log(target)  # > 0: the error is above the target, the ratio must rise
        off = abs(math.exp(gap) - 1.0)
        if off <= (AIM if self.moving else BAND):
            self.moving = False
            return
        if gap > 0:
            self.low = ratio
        else:
            self.high = ratio
        new = grid_ratio(self.next_index(gap, off > BAND))
        nearer = abs(gap - self.slope * math.log(new / ratio)) < abs(gap)
        self.moving = new != ratio and (off > BAND or nearer)
        if self.moving:
            self.ratio = new

    def next_index(self, gap: float, far: bool) -> int:
        """The grid index of the step from `self.ratio` whose estimated log error is `gap` above the target's:
        the damped step along the slope where `far` (outside the band), else the next grid ratio."""
        ratio = self.ratio
        here = grid_position(ratio)
        step = max(-math.log(MAX_FACTOR), min(math.log(MAX_FACTOR), DAMPING * gap / self.slope))
        index = round(here + step / _STEP) if far else round(here)
        # at least one grid ratio toward the target
        index = max(index, math.floor(here + _EPS) + 1) if gap > 0 else min(index, math.ceil(here - _EPS) - 1)
        if self.low is not None and self.high is not None:
            lo, hi = math.floor(grid_position(self.low) + _EPS) + 1, math.ceil(grid_position(self.high) - _EPS) - 1
            if lo > hi:  # no grid ratio inside the bracket
                other = self.high if gap > 0 else self.low
                beyond = gap - self.slope * math.log(other / ratio)  # the other end's error, as the slope says
                if beyond * gap <= 0 or abs(math.exp(beyond) - 1.0) <= BAND:
                    return round(here)  # the target lies between two neighbours: stay at this one
                self.low, self.high = (ratio, None) if gap > 0 else (None, ratio)  # the other end is stale
            elif not lo <= index <= hi:
                index = round((grid_position(self.low) + grid_position(self.high)) / 2)
                index = min(hi, max(lo, index))
        return min(_TOP, max(0, index))

    def weights(self) -> list[float]:
        """The measurements' weights, oldest first (the newest 1)."""
        return [FORGET ** (len(self.seen) - 1 - i) for i in range(len(self.seen))]

    def fitted_slope(self) -> float:
        """The weighted least-squares slope of the measurements, bounded to SLOPES; the slope so far while they
        hold fewer than two distinct ratios."""
        xs = [x for x, _ in self.seen]
        if max(xs) - min(xs) < 1e-9:
            return self.slope
        w = self.weights()
        mx = sum(a * x for a, x in zip(w, xs)) / sum(w)
        my = sum(a * y for a, (_, y) in zip(w, self.seen)) / sum(w)
        sxy = sum(a * (x - mx) * (y - my) for a, (x, y) in zip(w, self.seen))
        sxx = sum(a * (x - mx) ** 2 for a, x in zip(w, xs))
        return min(SLOPES[1], max(SLOPES[0], -sxy / sxx))

    def estimate(self) -> float:
        """The smoothed log error at `self.ratio`: the measurements' weighted mean, each carried along the slope."""
        w = self.weights()
        return sum(a * (y + self.slope * (x - math.log(self.ratio))) for a, (x, y) in zip(w, self.seen)) / sum(w)


class ErrorTarget:
    """One run's ratio per block under an error target."""

    def __init__(self) -> None:
        self.courses: dict[int, Course] = {}
        self.step = -1  # the latest step this run asked for
        self.learned = -1  # the latest measured step read

    def ratio(self, meter: ErrorMeter, layer: int, step: int | None, target: float, start: float) -> float:
        """Block `layer`'s ratio at `step`: learned from the latest measured step before it (read once a step).

        Args:
            meter: the run's measured errors, each with the ratio it was measured at.
            layer: the block index.
            step: the denoising step (None: no learning).
            target: the error to hold (relative L2 of video rows).
            start: the ratio before any measurement (``topk_ratio``).
        """
        if step is not None and step > self.step:
            self.step = step
            found = meter.last_step(before=step, after=self.learned)
            if found is not None:
                self.learned, measured = found
                for block, (ratio, error) in measured.items():
                    self.courses.setdefault(block, Course(start)).learn(ratio, error, target)
        course = self.courses.get(layer)
        return start if course is None else course.ratio
