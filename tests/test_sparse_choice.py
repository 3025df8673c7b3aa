"""The measured sparse-kernel choice on the CPU, with stand-in candidates (`sparse_standins.py`): the
fastest within the bound runs and its bits are returned; a raising or wrong candidate is said and
skipped; the precision setting is a bound; a chosen kernel that raises at call time is contained
(strict raises); the store keys choices per GPU, shape class and bound."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from sparse_standins import StandIn, Timer, row

from adaptive_sparse_attention import SequenceLayout, SparseConfig, sparse_attention
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.kernels.reference.reference import block_sparse_reference
from adaptive_sparse_attention.kernels.sparse_choice import choice as sparse_choice
from adaptive_sparse_attention.kernels.sparse_choice.choice import SparseChoices
from adaptive_sparse_attention.kernels.sparse_choice.sample import Sample, sampled_blocks

LAYOUT = [(0, 70, "text"), (70, 70 + 5 * 8 * 9, "video", (5, 8, 9))]  # edge blocks, 7 video blocks per row
CLOSE = 1 + 2 ** -12  # relative error 2.4e-4: within a bf16 bound at float32 (1.2e-3)
EIGHT_BIT_CLOSE = 1 + 2 ** -9  # 2e-3: beyond the bf16 bound, within the 8-bit one (4e-3)
WRONG = 1.1


def qkv(seed: int = 0, heads: int = 3):
    layout = SequenceLayout.from_segments(LAYOUT)
    g = torch.Generator().manual_seed(seed)
    return layout, *(torch.randn(1, heads, layout.total, 32, generator=g) for _ in range(3))


def candidates(monkeypatch, *rows) -> None:
    """Declare `rows` as the table's sparse candidates (as a family's `SPARSE_KERNELS` rows)."""
    monkeypatch.setattr(sparse_choice, "SPARSE_KERNELS", tuple(rows))


def call(choices, precision="bf16", strict=False, seed=0, **changes):
    layout, q, k, v = qkv(seed)
    config = SparseConfig(**{"topk_ratio": 0.3, "tiling": "cube", "precision": precision, "strict": strict, **changes})
    return sparse_attention(q, k, v, layout, config, return_info=True, choices=choices), (layout, q, k, v, config)


def expected(standin_factor, setup):
    layout, q, k, v, config = setup
    plan = build_plan(q, k, v, layout, config)
    return block_sparse_reference(q, k, v, plan)[0] * standin_factor


@pytest.mark.parametrize("fast", ["a", "b"])
def test_the_fastest_candidate_within_the_bound_runs_and_its_bits_are_returned(monkeypatch, caplog, fast):
    a, b = StandIn("a", CLOSE), StandIn("b", 2 - CLOSE)
    candidates(monkeypatch, row(a), row(b))
    timer = Timer([a, b], {"a": 1.0 if fast == "a" else 3.0, "b": 2.0})
    choices = SparseChoices(timer=timer)
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        (out, info), setup = call(choices)
        (again, _), _ = call(choices)
    assert info.kernel == fast
    assert torch.equal(out, expected(a.factor if fast == "a" else b.factor, setup))
    assert torch.equal(again, out)
    assert sorted(timer.timed) == ["a", "b"]  # timed once each, on the first call only
    said = [r.getMessage() for r in caplog.records]
    chosen = [m for m in said if m.startswith("sparse attention for") and "measured" in m]
    assert len(chosen) == 1 and f"runs on stand-in {fast}" in chosen[0] and "ratio class 0.4" in chosen[0], said


def test_a_raising_candidate_is_skipped_with_a_warning_naming_it(monkeypatch, caplog):
    good, bad = StandIn("good", CLOSE), StandIn("bad", CLOSE, fails_from=1)
    candidates(monkeypatch, row(bad), row(good))
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        (out, info), setup = call(SparseChoices(timer=Timer([good, bad], {"good": 2.0, "bad": 1.0})), strict=True)
    assert info.kernel == "good" and torch.equal(out, expected(good.factor, setup))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("stand-in bad failed" in m and "UnicodeDecodeError" in m and m.endswith("skipped") for m in warned)


def test_a_wrong_candidate_is_rejected_by_the_bound(monkeypatch, caplog):
    right, wrong = StandIn("right", CLOSE), StandIn("wrong", WRONG)
    candidates(monkeypatch, row(wrong), row(right))
    timer = Timer([right, wrong], {"right": 2.0, "wrong": 1.0})
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        (out, info), setup = call(SparseChoices(timer=timer))
    assert info.kernel == "right" and torch.equal(out, expected(right.factor, setup))
    assert timer.timed == ["right"]  # the wrong one is not timed
    assert any("stand-in wrong differs" in r.getMessage() and "1.00e-01" in r.getMessage() for r in caplog.records)


def test_the_precision_is_a_bound_not_a_kernel(monkeypatch):
    """An 8-bit kernel is no candidate under a bf16 bound; under an 8-bit bound a faster bf16 kernel wins,
    and the 8-bit one wins only where it is faster."""
    bf16, eight = StandIn("bf16", CLOSE), StandIn("eight", EIGHT_BIT_CLOSE)
    candidates(monkeypatch, row(bf16), row(eight, precision="8-bit"), row(StandIn("other", CLOSE)))
    for precision, ms, chosen in (("bf16", {"bf16": 2.0, "eight": 1.0}, "bf16"),
                                  ("8-bit", {"bf16": 1.0, "eight": 2.0}, "bf16"),
                                  ("8-bit", {"bf16": 2.0, "eight": 1.0}, "eight")):
        timer = Timer([bf16, eight, StandIn("other", CLOSE)], {**ms, "other": 9.0})
        (out, info), _ = call(SparseChoices(timer=timer), precision=precision)
        assert info.kernel == chosen, (precision, ms)
        assert ("eight" in timer.timed) is (precision == "8-bit")


def test_a_chosen_kernel_that_raises_at_call_time_is_contained(monkeypatch, caplog):
    """Issue 46: the chosen kernel raising in a later call (cuDNN-frontend's UnicodeDecodeError) is said once,
    the call and the next ones run on the next kernel; strict mode raises."""
    first, second = StandIn("first", CLOSE, fails_from=6), StandIn("second", 2 - CLOSE)
    candidates(monkeypatch, row(first), row(second))
    choices = SparseChoices(timer=Timer([first, second], {"first": 1.0, "second": 2.0}))
    (out, info), setup = call(choices)  # measured: 1 check + 1 timing call each, then the call: 3 calls of first
    assert info.kernel == "first"
    layout, q, k, v, config = setup
    call_once = lambda: sparse_attention(q, k, v, layout, config, return_info=True, choices=choices)  # noqa: E731
    call_once()  # call 4
    call_once()  # call 5
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        out, info = call_once()  # raises inside: runs on the next kernel
        again, info2 = call_once()
    assert info.kernel == info2.kernel == "second"
    assert torch.equal(out, expected(second.factor, setup)) and torch.equal(again, out)
    said = [r.getMessage() for r in caplog.records if "stand-in first raised UnicodeDecodeError" in r.getMessage()]
    assert len(said) == 1 and "runs on stand-in second" in said[0]
    assert "sparse_standins.py" in said[0] and "in attend_blocks" in said[0]  # where it was raised
    assert "bytes 110-190 of the 171: b'" in said[0] and "Used 168 registers\\n\\xb6'" in said[0]  # which text
    assert first.calls == 6  # not tried again after it raised

    strict_first, strict_second = StandIn("first", CLOSE, fails_from=4), StandIn("second", 2 - CLOSE)
    candidates(monkeypatch, row(strict_first), row(strict_second))
    choices = SparseChoices(timer=Timer([strict_first, strict_second], {"first": 1.0, "second": 2.0}))
    call(choices, strict=True)
    with pytest.raises(RuntimeError, match="stand-in first raised UnicodeDecodeError.*strict mode"):
        call(choices, strict=True)


def test_fewer_than_two_candidates_run_the_registry_family(monkeypatch):
    only = StandIn("only", WRONG)
    candidates(monkeypatch, row(only))
    (out, info), setup = call(SparseChoices(timer=lambda fn: pytest.fail("nothing to measure")))
    assert info.kernel == "torch" and only.calls == 0
    candidates(monkeypatch)
    (_, info), _ = call(None)  # the layout's own choices
    assert info.kernel == "torch"


def test_a_named_kernel_is_not_measured(monkeypatch):
    a, b = StandIn("a", CLOSE), StandIn("b", CLOSE)
    candidates(monkeypatch, row(a), row(b))
    (_, info), _ = call(SparseChoices(timer=lambda fn: pytest.fail("not measured")), kernel="torch")
    assert info.kernel == "torch" and a.calls == b.calls == 0


def test_the_sample_reference_is_the_oracle_on_the_sampled_rows():
    layout, q, k, v = qkv()
    config = SparseConfig(topk_ratio=0.3)
    plan = build_plan(q, k, v, layout, config)
    sample = Sample.of(q, k, v, plan)
    full = block_sparse_reference(q.double(), k.double(), v.double(), plan)[0]
    assert sample.error(full) < 1e-6
    assert sample.error(full * 1.01) == pytest.approx(0.01, rel=1e-3)
    assert sampled_blocks(3) == (0, 1, 2) and sampled_blocks(100, 4) == (0, 33, 66, 99)
    assert sample.slots.numel() == min(plan.num_blocks, 16) * plan.block_size


def test_the_store_keys_choices_per_gpu_shape_class_and_bound(monkeypatch, tmp_path):
    a, b = StandIn("a", CLOSE), StandIn("b", 2 - CLOSE)
    candidates(monkeypatch, row(a), row(b))
    path = tmp_path / "sparse.json"
    ms = {"a": 2.0, "b": 1.0}
    for gpu in ("NVIDIA H200", "NVIDIA RTX 4090"):
        monkeypatch.setattr(SparseChoices, "describe_device", lambda self, device, gpu=gpu: f"pack|{gpu}|sm90")
        for precision in ("bf16", "8-bit"):
            call(SparseChoices(path, timer=Timer([a, b], ms), persist=True), precision=precision)
    call(SparseChoices(path, timer=Timer([a, b], ms), persist=True), topk_ratio=0.1)  # another ratio class
    saved = json.loads(path.read_text())
    assert len(saved) == 5 and set(saved.values()) == {"b,a"}
    assert {key.split("|")[1] for key in saved} == {"NVIDIA H200", "NVIDIA RTX 4090"}
    assert {key.rsplit("bound ", 1)[1] for key in saved} == {"bf16", "8-bit"}
    assert {key.split("ratio class ")[1].split()[0] for key in saved} == {"0.4", "0.1"}

    # a later process takes the saved choice after one check, without timing anything
    later = SparseChoices(path, timer=lambda fn: pytest.fail("the saved choice is not timed again"), persist=True)
    (out, info), setup = call(later, topk_ratio=0.1)
    assert info.kernel == "b" and torch.equal(out, expected(b.factor, setup))
    # a saved kernel that no longer meets the bound here is measured again
    bad = StandIn("b", WRONG)
    candidates(monkeypatch, row(a), row(bad))
    timer = Timer([a, bad], ms)
    (_, info), _ = call(SparseChoices(path, timer=timer, persist=True), topk_ratio=0.1)
    assert info.kernel == "a" and timer.timed == ["a"]
    resaved = json.loads(path.read_text())
    assert len(resaved) == 5 and sorted(resaved.values()) == ["a"] + ["b,a"] * 4
