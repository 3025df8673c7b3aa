"""A sticky CUDA error (the context is lost: every later kernel would fail too) stops the sparse and dense
choices with that error instead of moving to the next candidate; other failures still move on (stand-ins on
the CPU, `sparse_standins.py`)."""
from __future__ import annotations

import pytest
import torch

from sparse_standins import StandIn, Timer, row
from test_sparse_choice import CLOSE, call, candidates

from adaptive_sparse_attention.kernels.cuda_errors import poisons_context
from adaptive_sparse_attention.kernels.dense.choice import agrees, fastest
from adaptive_sparse_attention.kernels.sparse_choice.choice import SparseChoices

ILLEGAL = "CUDA error: an illegal memory access was encountered"


def sticky() -> Exception:
    return getattr(torch, "AcceleratorError", RuntimeError)(ILLEGAL)


def test_sticky_errors_are_told_from_the_others():
    assert poisons_context(RuntimeError(ILLEGAL))
    assert poisons_context(RuntimeError("Triton Error [CUDA]: unspecified launch failure"))
    assert poisons_context(RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS"))
    try:
        try:
            raise RuntimeError(ILLEGAL)
        except RuntimeError as inner:
            raise ValueError("the kernel failed") from inner
    except ValueError as outer:
        assert poisons_context(outer)  # raised from a sticky error
    assert not poisons_context(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not poisons_context(UnicodeDecodeError("utf-8", b"\xb6", 0, 1, "invalid start byte"))
    assert not poisons_context(ValueError("head_dim=48 is not supported"))


def test_a_sticky_error_while_measuring_stops_the_call(monkeypatch):
    error = sticky()
    first, second = StandIn("first", CLOSE, fails_from=1, error=error), StandIn("second", CLOSE)
    candidates(monkeypatch, row(first), row(second))
    with pytest.raises(type(error)) as raised:
        call(SparseChoices(timer=Timer([first, second], {"first": 1.0, "second": 2.0})))
    assert raised.value is error
    assert second.calls == 0  # the next candidate is not tried on a lost context


def test_a_sticky_error_of_the_chosen_kernel_at_call_time_stops_the_call(monkeypatch):
    error = sticky()
    first, second = StandIn("first", CLOSE, fails_from=4, error=error), StandIn("second", CLOSE)
    candidates(monkeypatch, row(first), row(second))
    choices = SparseChoices(timer=Timer([first, second], {"first": 1.0, "second": 2.0}))
    (_, info), _ = call(choices)  # measured (check + timing of each), then the call: 3 calls of first
    assert info.kernel == "first"
    measured = second.calls
    with pytest.raises(type(error)) as raised:
        call(choices)
    assert raised.value is error and second.calls == measured  # not run after the sticky error


def test_the_dense_choice_stops_on_a_sticky_error_and_skips_other_failures():
    reference = torch.zeros(2, 4)
    notes = []

    def run(name):
        if name == "sticky":
            raise sticky()
        if name == "oom":
            raise RuntimeError("CUDA out of memory")
        return reference

    assert not agrees("oom", run, reference, 1e-3, lambda message, *level: notes.append(message))
    assert notes and "oom" in notes[0]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        agrees("sticky", run, reference, 1e-3)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        fastest(("oom", "sticky", "good"), run, lambda fn: 1.0, reference, 1e-3, lambda *a: None)
    assert fastest(("oom", "good"), run, lambda fn: 1.0, reference, 1e-3, lambda *a: None) == "good"
