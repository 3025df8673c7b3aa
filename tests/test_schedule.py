"""Denoising-step counting, warmup, dense reasons and per-run state of nodes/schedule.py."""
from __future__ import annotations

import logging

import pytest
import torch

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.nodes.run_tracker import RunTracker
from adaptive_sparse_attention.nodes.schedule import denoising_step, schedule_reason, warmup_steps


def karras_like(steps: int) -> torch.Tensor:
    s = torch.linspace(1.0, 0.0, steps + 1) ** 2 * 14.6
    return s


def test_denoising_step_is_the_nearest_schedule_entry():
    sched = karras_like(8)
    for i in range(8):
        assert denoising_step(sched[i:i + 1], sched) == (i, 8)
        # a sigma between two entries (e.g. a second-order sampler's midpoint) rounds to the nearer one
        mid = 0.8 * sched[i] + 0.2 * sched[i + 1]
        assert denoising_step(mid.view(1), sched)[0] == i
    assert denoising_step(torch.tensor([0.0]), sched) == (7, 8)  # the final 0 is not a step of its own
    with pytest.raises(ValueError, match="at least 2"):
        denoising_step(torch.tensor([1.0]), torch.tensor([1.0]))


@pytest.mark.parametrize("ratio,total,expected", [(0.2, 20, 4), (0.2, 15, 3), (0.2, 19, 4), (0.0, 10, 0),
                                                  (1.0, 7, 7), (0.25, 1, 1), (0.5, 3, 2)])
def test_fidelity_warmup_is_ceil_of_ratio_times_steps(ratio, total, expected):
    assert warmup_steps(SparseConfig(warmup_ratio=ratio), total) == expected


def test_speed_and_dense_modes():
    assert warmup_steps(SparseConfig(warmup_mode="speed", warmup_ratio=0.5), 10) == 0
    assert warmup_steps(SparseConfig(warmup_mode="dense"), 10) == 10
    assert schedule_reason(SparseConfig(warmup_mode="dense"), 0, 9, 10, 10**6) == "warmup_mode='dense'"


def test_schedule_reasons():
    cfg = SparseConfig(warmup_ratio=0.2, dense_layers="0,3-4", min_tokens=1000)
    assert "warmup (step 2 of 10)" == schedule_reason(cfg, 1, 1, 10, 5000)
    assert "layer 3 is in dense_layers" == schedule_reason(cfg, 3, 5, 10, 5000)
    assert "999 tokens < min_tokens=1000" == schedule_reason(cfg, 1, 5, 10, 999)
    assert schedule_reason(cfg, 1, 2, 10, 1000) is None
    assert schedule_reason(cfg, 1, None, None, 1000) is None  # unknown step: no warmup can apply


def calls(tracker: RunTracker, sched: torch.Tensor, cfg_pairs: bool = True) -> list[tuple]:
    out = []
    for i in range(sched.numel() - 1):
        for _ in range(2 if cfg_pairs else 1):
            out.append(tracker.step_of({"sigmas": sched[i:i + 1], "sample_sigmas": sched}))
    return out


def test_cfg_pairs_count_once_and_a_new_schedule_is_a_new_run(caplog):
    tracker = RunTracker("t")
    sched = karras_like(6)
    steps = calls(tracker, sched)
    assert steps == [(i, 6) for i in range(6) for _ in range(2)]
    for step, _ in steps:
        tracker.note_block(step, sparse=step >= 2, density=0.25)
    tracker.log_once("something")
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        calls(tracker, karras_like(4))  # another sampler run with another schedule
    summaries = [r.getMessage() for r in caplog.records if "steps" in r.getMessage()]
    assert summaries == ["t: steps 2 dense / 4 sparse; blocks 4 dense / 8 sparse; mean density 0.250 in sparse "
                         "blocks (0.500 over all blocks); sparse attention time 0.00 s"]
    assert tracker.stats.dense_blocks == 0 and tracker.logged == set()  # fresh run state


def test_log_once_per_run_and_reset(caplog):
    tracker = RunTracker("t")
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        for _ in range(3):
            tracker.log_once("layer 2 runs dense: reason")
        tracker.finish()
        tracker.log_once("layer 2 runs dense: reason")
    assert sum("layer 2 runs dense" in r.getMessage() for r in caplog.records) == 2
    assert tracker.finish() is None  # nothing ran: no summary


def test_missing_schedule_is_reported_not_guessed(caplog):
    tracker = RunTracker("t")
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        assert tracker.step_of({"sigmas": torch.tensor([0.5])}) == (None, None)
        assert tracker.step_of({}) == (None, None)
    assert sum("sample_sigmas" in r.getMessage() for r in caplog.records) == 1


def test_timers_accumulate_without_growing():
    tracker = RunTracker("t")
    x = torch.zeros(4)
    for _ in range(50):
        tracker.stop_timer(tracker.start_timer(x))
    assert tracker.stats.attention_ms > 0 and tracker._pending == []
    tracker.finish()
    assert tracker.stats.attention_ms == 0
