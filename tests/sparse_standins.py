"""Stand-in sparse kernels on the CPU, declared as a family declares its rows (`SparseKernel` over an
attention `Implementation`), for the tests of the measured sparse choice.

A stand-in returns the torch reference's output times a recognisable factor, raises when told to, and
records its calls; `Timer` times each stand-in at a set number of milliseconds (CPU timings at test
sizes are noise), so which one is fastest is the test's decision.
"""
from __future__ import annotations

from adaptive_sparse_attention.kernels.reference.reference import ReferenceAttention
from adaptive_sparse_attention.kernels.vocabulary import Implementation, SparseKernel


class StandIn:
    """The attention object of one stand-in row: the reference times `factor`; raises `error` from call
    number `fails_from` on (None: never)."""

    def __init__(self, name: str, factor: float, fails_from: int | None = None,
                 error: Exception | None = None):
        self.name, self.factor, self.fails_from = name, factor, fails_from
        text = b"ptxas info   : Used 168 registers\n" * 5 + b"\xb6"  # a log with one bad byte at 170
        self.error = error or UnicodeDecodeError("utf-8", text, 170, 171, "invalid start byte")
        self.calls = 0

    def attend_blocks(self, q, k, v, plan, precision="bf16"):
        self.calls += 1
        if self.fails_from is not None and self.calls >= self.fails_from:
            raise self.error
        out, lse = ReferenceAttention().attend_blocks(q, k, v, plan)
        return out * self.factor, lse


def row(standin: StandIn, precision: str = "bf16") -> SparseKernel:
    """`standin` as a candidate row on the CPU."""
    return SparseKernel(standin.name, f"stand-in {standin.name}",
                        Implementation("attention", "standin", lambda: standin), precision=precision, devices=("cpu",))


class Timer:
    """Milliseconds of each stand-in by name: times the thunk's call as the stand-in it ran."""

    def __init__(self, standins: list[StandIn], ms: dict[str, float]):
        self.standins, self.ms = standins, ms
        self.timed: list[str] = []

    def __call__(self, fn) -> float:
        before = {s.name: s.calls for s in self.standins}
        fn()
        name = next(s.name for s in self.standins if s.calls > before[s.name])
        self.timed.append(name)
        return self.ms[name]
