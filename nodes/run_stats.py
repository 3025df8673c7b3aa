"""The counters of one sampling run (`RunStats`) and its calls timed against dense attention (`ShapeTiming`):
plain records that the run's tracker fills (`run_tracker`), its timers add to (`run_timers`) and its report reads
(`run_report`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .error_meter import ErrorMeter
from .error_target import ErrorTarget


@dataclass
class ShapeTiming:
    """One call of a shape (layout and ratio) timed against the dense attention that would have run there.

    Attributes:
        sparse_ms: the sparse op's milliseconds on the timed head groups.
        dense_ms: the dense attention's milliseconds on the same head groups.
        share: the share of a block call's heads the timed head groups hold (1.0: the whole call).
        baseline: the dense attention timed, as the report names it.
    """

    sparse_ms: float = 0.0
    dense_ms: float = 0.0
    share: float = 0.0
    baseline: str = ""


@dataclass
class RunStats:
    """Counters of one sampling run."""

    dense_steps: set[int] = field(default_factory=set)
    sparse_steps: set[int] = field(default_factory=set)
    dense_blocks: int = 0
    sparse_blocks: int = 0
    density_sum: float = 0.0  # over sparse block calls
    attention_ms: float = 0.0  # our attention in sparse blocks
    layers: dict[int, list[int]] = field(default_factory=dict)  # layer -> [dense calls, sparse calls]
    dense_reasons: dict[str, int] = field(default_factory=dict)  # why block calls ran dense -> count
    shape_calls: dict[tuple, int] = field(default_factory=dict)  # timing key (layout, ratio) -> sparse block calls
    timings: dict[tuple, ShapeTiming] = field(default_factory=dict)  # timing key -> its call timed against dense
    dense_kernels: dict[str, int] = field(default_factory=dict)  # kernel of our dense override -> calls
    sparse_kernels: dict[str, int] = field(default_factory=dict)  # sparse attention kernel -> calls
    sparse_choices: list[str] = field(default_factory=list)  # the measured sparse choices' summaries used
    notes: list[str] = field(default_factory=list)  # what the run's report says besides its counters
    errors: ErrorMeter = field(default_factory=ErrorMeter)  # the sparse calls' sampled error, on the device
    target: ErrorTarget = field(default_factory=ErrorTarget)  # the blocks' ratios under error_target
