"""Denoising steps, the warmup rule and dense reasons (nodes/schedule.py), and what one run is
(nodes/run_tracker.py)."""
from __future__ import annotations

import logging

import pytest
import torch

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.nodes.run_tracker import RunTracker
from adaptive_sparse_attention.backend.config import WARMUP_MODES
from adaptive_sparse_attention.nodes.schedule import (denoising_step, ramp_ratio, schedule_reason, start_sigma,
                                                        warmup_reason, warmup_sigma, warmup_steps)


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
    assert schedule_reason(SparseConfig(warmup_mode="dense"), 0, None, 10**6) == "warmup_mode='dense'"
    assert warmup_reason(SparseConfig(warmup_mode="speed"), 1.0, 0.5, (0, 4)) is None


def test_schedule_reasons():
    cfg = SparseConfig(warmup_ratio=0.2, dense_layers="0,3-4", min_tokens=1000)
    warm = warmup_reason(cfg, 0.9, None, (1, 10))
    assert warm == "warmup (step 2 of 10)" == schedule_reason(cfg, 1, warm, 5000)
    assert "layer 3 is in dense_layers" == schedule_reason(cfg, 3, None, 5000)
    assert "999 tokens < min_tokens=1000" == schedule_reason(cfg, 1, None, 999)
    assert schedule_reason(cfg, 1, warmup_reason(cfg, 0.7, None, (2, 10)), 1000) is None
    assert warmup_reason(cfg, None, 0.8, None) is None  # unknown sigma: no warmup can apply


def flow_sampling(shift: float):
    """ComfyUI's flow model sampling (SD3 / H3 style): sigma(t) = shift t / (1 + (shift - 1) t)."""
    from types import SimpleNamespace

    def sigma(t: torch.Tensor) -> torch.Tensor:
        return shift * t / (1 + (shift - 1) * t)

    def percent_to_sigma(p: float) -> float:
        return 1.0 if p <= 0 else 0.0 if p >= 1 else float(sigma(torch.tensor(1.0 - p, dtype=torch.float64)))
    return SimpleNamespace(sigma=sigma, percent_to_sigma=percent_to_sigma)


def simple_schedule(sampling, steps: int) -> torch.Tensor:
    """ComfyUI's "simple" scheduler over 1000 float32 model sigmas: every (1000 / steps)-th, then 0."""
    table = sampling.sigma(torch.arange(1, 1001, dtype=torch.float64) / 1000).float()
    return torch.tensor([float(table[-(1 + int(i * 1000 / steps))]) for i in range(steps)] + [0.0])


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.2, 0.25, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("steps", [1, 4, 8, 20, 30])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_the_sigma_rule_runs_ceil_ratio_times_steps_dense_on_the_simple_schedule(ratio, steps, shift):
    """The README's count: with the "simple" scheduler the sigma rule runs exactly the steps the
    step-count rule names, at any flow shift, float32 schedule rounding included."""
    sampling, cfg = flow_sampling(shift), SparseConfig(warmup_ratio=ratio)
    sched = simple_schedule(sampling, steps)
    threshold = warmup_sigma(cfg, sampling.percent_to_sigma)
    dense = [warmup_reason(cfg, float(s), threshold, None) is not None for s in sched[:-1]]
    assert dense == [i < warmup_steps(cfg, steps) for i in range(steps)]


def test_a_split_schedule_runs_the_dense_steps_of_the_whole_one():
    """KSamplerAdvanced 0-2 then 2-4 (or SplitSigmas): each sampler call sees only its part of the
    sigmas; the steps, the run and the warmup are those of the whole schedule."""
    sampling, cfg = flow_sampling(3.0), SparseConfig(warmup_ratio=0.25)
    sched = simple_schedule(sampling, 4)
    threshold = warmup_sigma(cfg, sampling.percent_to_sigma)
    whole, split = RunTracker("whole"), RunTracker("split")
    unsplit = [whole.step_of({"sigmas": sched[i:i + 1], "sample_sigmas": sched}) for i in range(4)]
    parts = [split.step_of({"sigmas": sched[i:i + 1], "sample_sigmas": part})
             for part in (sched[:3], sched[2:]) for i in range(4) if part[0] >= sched[i] > part[-1]]
    assert [p[0] for p in parts] == [u[0] for u in unsplit] == [0, 1, 2, 3]
    assert [warmup_reason(cfg, p[1], threshold, p[2]) is not None for p in parts] == [True, False, False, False]
    assert split.run_sigmas == whole.run_sigmas  # one run across both calls


def test_ramp_is_appended_to_the_warmup_modes():
    """Saved workflows store the value: the earlier choices keep their places."""
    assert WARMUP_MODES == ("fidelity", "speed", "dense", "ramp")


def ramp(cfg: SparseConfig, sampling, sigmas) -> list[float]:
    """The density of a call at every sigma (1.0 where the warmup rule runs it dense)."""
    threshold, start = warmup_sigma(cfg, sampling.percent_to_sigma), start_sigma(sampling)
    out = []
    for s in sigmas:
        dense = warmup_reason(cfg, float(s), threshold, None, start) is not None
        out.append(1.0 if dense else ramp_ratio(cfg, float(s), threshold, start, None))
    return out


def test_ramp_is_dense_at_the_start_linear_in_sigma_and_floored_at_topk_ratio():
    sampling = flow_sampling(10.0)
    cfg = SparseConfig(topk_ratio=0.1, warmup_ratio=0.5, warmup_mode="ramp")
    sw = warmup_sigma(cfg, sampling.percent_to_sigma)
    mid = (1.0 + sw) / 2
    assert ramp(cfg, sampling, [1.0, mid, sw, sw / 2, 0.0]) == pytest.approx([1.0, 0.55, 0.1, 0.1, 0.1])
    assert warmup_reason(cfg, 1.0, sw, None, 1.0).startswith("warmup (ramp: dense at sigma 1")
    assert warmup_reason(cfg, mid, sw, None, 1.0) is None  # a ramped step runs sparse
    dens = ramp(cfg, sampling, simple_schedule(sampling, 20)[:-1])
    assert dens[0] == 1.0 and dens == sorted(dens, reverse=True) and min(dens) == 0.1
    # the other modes run topk_ratio on every sparse call
    for mode in ("fidelity", "speed"):
        assert ramp_ratio(cfg.replace(warmup_mode=mode), mid, sw, 1.0, None) == 0.1


def test_ramp_spans_the_fidelity_warmup_and_is_speed_without_one():
    sampling = flow_sampling(3.0)
    for steps in (4, 8, 20):
        sched = simple_schedule(sampling, steps)[:-1]
        cfg = SparseConfig(topk_ratio=0.2, warmup_ratio=0.2, warmup_mode="ramp")
        above = [d > 0.2 for d in ramp(cfg, sampling, sched)]
        assert above == [i < warmup_steps(cfg, steps) for i in range(steps)]  # the fidelity span, no more
        assert ramp(cfg.replace(warmup_ratio=0.0), sampling, sched) == [0.2] * steps


def test_ramp_without_the_model_sampling_counts_the_calls_steps():
    cfg = SparseConfig(topk_ratio=0.1, warmup_ratio=0.5, warmup_mode="ramp")
    assert [ramp_ratio(cfg, 0.5, None, None, (i, 8)) for i in range(8)] == pytest.approx(
        [1.0, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1, 0.1])
    assert ramp_ratio(cfg, None, 0.5, 1.0, (0, 8)) == 0.1  # no sigma: no ramp
    assert warmup_reason(cfg, 0.5, None, (0, 8)) is not None  # step 0 dense


def test_start_sigma_is_the_models_sigma_max():
    from types import SimpleNamespace

    assert start_sigma(SimpleNamespace(sigma_max=14.6, percent_to_sigma=lambda p: 999999999.9)) == 14.6
    assert start_sigma(flow_sampling(3.0)) == 1.0


def test_a_split_schedule_ramps_as_the_whole_one():
    """KSamplerAdvanced 0-4 then 4-8: every call's density is the unsplit run's (by sigma)."""
    sampling = flow_sampling(3.0)
    cfg = SparseConfig(topk_ratio=0.1, warmup_ratio=0.6, warmup_mode="ramp")
    sched = simple_schedule(sampling, 8)
    whole = ramp(cfg, sampling, sched[:-1])
    split = ramp(cfg, sampling, sched[:4]) + ramp(cfg, sampling, sched[4:-1])
    assert split == whole and len(set(whole)) > 3  # several ramped densities, the same in both
    easycache = [d for i, d in enumerate(whole) if i not in (2, 3)]  # steps a step cache skipped change nothing
    assert ramp(cfg, sampling, [s for i, s in enumerate(sched[:-1]) if i not in (2, 3)]) == easycache


def test_a_run_ends_when_the_sigma_goes_up(caplog):
    """A rerun (new prompt, or after an interrupt) starts at a higher sigma: a new run; the summary
    of a run is logged once: when a sampler call that ran its last step ends, else when the next
    run starts."""
    tracker, sched = RunTracker("t"), karras_like(4)
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        for i in range(2):  # interrupted after two steps
            tracker.note_block(tracker.step_of({"sigmas": sched[i:i + 1], "sample_sigmas": sched})[0], sparse=False)
        assert tracker.end_call() is None
        assert tracker.last_report["steps_dense"] == [0, 1]  # not at sigma 0 yet
        for i in range(4):
            tracker.note_block(tracker.step_of({"sigmas": sched[i:i + 1], "sample_sigmas": sched})[0], sparse=i > 0)
        line = tracker.end_call()
    assert tracker.last_report["steps_dense"] == [0]
    assert tracker.last_report["steps_sparse"] == [1, 2, 3]
    assert "steps 1 dense / 3 sparse" in line
    assert tracker.end_call() is None  # logged once
    logged = [r.getMessage() for r in caplog.records if "steps" in r.getMessage()]
    assert logged[1:] == [line]
    assert "steps 2 dense / 0 sparse" in logged[0]  # the interrupted run, at the rerun


def calls(tracker: RunTracker, sched: torch.Tensor, cfg_pairs: bool = True) -> list[tuple]:
    out = []
    for i in range(sched.numel() - 1):
        for _ in range(2 if cfg_pairs else 1):
            step, _, segment = tracker.step_of({"sigmas": sched[i:i + 1], "sample_sigmas": sched})
            out.append((step, segment[1]))
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
        calls(tracker, karras_like(4))  # another sampler run: it starts above the last sigma
    summaries = [r.getMessage() for r in caplog.records if "steps" in r.getMessage()]
    assert summaries == ["t: steps 2 dense / 4 sparse; blocks 4 dense / 8 sparse; mean density 0.250 in sparse "
                         "blocks (0.500 over all blocks); sparse attention time 0.00 s; precision bf16"]
    assert tracker.stats.dense_blocks == 0
    assert len(tracker.notices) == 0  # fresh run state


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
        assert tracker.step_of({"sigmas": torch.tensor([0.5])}) == (None, None, None)
        assert tracker.step_of({}) == (None, None, None)
    assert sum("sample_sigmas" in r.getMessage() for r in caplog.records) == 1


def test_timers_accumulate_without_growing():
    tracker = RunTracker("t")
    x = torch.zeros(4)
    for _ in range(50):
        tracker.stop_timer(tracker.start_timer(x))
    assert tracker.stats.attention_ms > 0
    assert tracker.timers.blocks == [] and tracker.timers.timings == []
    tracker.finish()
    assert tracker.stats.attention_ms == 0
