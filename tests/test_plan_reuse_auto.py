"""plan_reuse="auto" (backend/plan_reuse.py `PlanStore.decide`, nodes/plan_estimate.py): once per run and shape,
at its first plan, keep the shape's plans where that plan's measured bytes times the slots the run fills
(sparse blocks x branches x head groups), plus what other shapes keep, fit the memory budget, else plan
afresh everywhere; said once with the numbers. "off" and "on" keep their meaning."""
from __future__ import annotations

import logging

import pytest
import torch

from adaptive_sparse_attention.backend import plan_reuse
from adaptive_sparse_attention.backend.plan_reuse import Estimate, PlanStore, size_text
from adaptive_sparse_attention.nodes.plan_estimate import branch_count
from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook
from h3_block import block_args
from h3_harness import PACKED, config, model_of, options, run_model

GIB = 2**30
CPU = torch.device("cpu")
PACKED_ROWS = 267  # PACKED's rows: text 5, audio 6, video 256


def sampled(monkeypatch, budget: int | None = None, steps=(3, 4, 5), layers: int = 2, **kw):
    """Steps of one run of a `layers`-block model through the hook (`budget`: the plans' memory budget)."""
    if budget is not None:
        monkeypatch.setattr(plan_reuse, "memory_budget", lambda device: budget)
    model = model_of(True, seed=2, layers=layers)
    args = block_args(model.blocks[0], PACKED, seed=3, new=True)
    chunks = kw.pop("minimax_head_chunks", 1)
    hook = SparseAttentionHook(config(**kw))
    outs = []
    for step in steps:
        args["transformer_options"] = options(step, minimax_head_chunks=chunks)
        outs.append(run_model(model, hook, args, True))
    return hook, outs


def plan_size(monkeypatch) -> int:
    """Bytes one kept plan of the test shape holds (every block's plan has the same size)."""
    hook, _ = sampled(monkeypatch, steps=(3,), plan_reuse="on")
    (size,) = {slot.size for slot in hook.tracker.plans.slots.values()}
    assert size > 0
    return size


def auto_notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "plan_reuse auto" in r.getMessage()]


@pytest.mark.parametrize("slack", [0, -1])
def test_auto_keeps_the_plans_where_the_runs_estimate_fits_and_not_one_byte_past(monkeypatch, caplog, slack):
    size = plan_size(monkeypatch)
    budget = 2 * size + slack  # two blocks x one branch x one head group
    caplog.clear()
    with caplog.at_level(logging.INFO):
        hook, outs = sampled(monkeypatch, budget)
    (notice,) = auto_notices(caplog)
    counted = f"(2 sparse blocks x 1 branch x 1 head group = 2 plans of {size_text(size)})"
    if slack == 0:
        assert notice.endswith(f"plan_reuse auto: on for the {PACKED_ROWS}-row shape: its kept plans need about "
                               f"{size_text(2 * size)} {counted}, within the memory budget of {size_text(budget)} "
                               "(the budget off a GPU)")
        assert hook.tracker.plans.summary() == {"reused": 4, "built": 2, "rebuilds": 0, "built: first": 2}
    else:
        assert f"off for the {PACKED_ROWS}-row shape: its kept plans would need about {size_text(2 * size)} " \
               f"{counted}, past the memory budget of {size_text(budget)}" in notice
        assert hook.tracker.plans.summary() == {"reused": 0, "built": 0, "rebuilds": 0}  # as "off" counts
        assert not hook.tracker.plans.slots and hook.tracker.plans.used == {"cpu": 0}
    assert hook.tracker.stats.notes == [notice.split(": ", 1)[1]]  # in the report too
    _, fresh = sampled(monkeypatch, budget, plan_reuse="off")
    for out, expected in zip(outs, fresh):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)  # a kept plan is the fresh one


def layout_key(hook: SparseAttentionHook):
    (shape,) = hook.tracker.plans.auto
    return shape


def test_auto_does_not_flip_where_on_keeps_the_first_blocks(monkeypatch, caplog):
    """With room for one plan of two, auto plans afresh at every block and step of the run (one verdict, said
    once); "on" under the same budget keeps the first block's plan and says the budget once, as before."""
    size = plan_size(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        auto, _ = sampled(monkeypatch, size + size // 2, steps=(3, 4, 5, 6))
        assert len(auto_notices(caplog)) == 1 and auto.tracker.plans.verdict(layout_key(auto)) is False
        assert auto.tracker.plans.summary()["built"] == 0 and not auto.tracker.plans.slots
        on, _ = sampled(monkeypatch, size + size // 2, steps=(3, 4, 5, 6), plan_reuse="on")
    assert on.tracker.plans.summary() == {"reused": 3, "built": 5, "rebuilds": 0, "built: first": 2,
                                          "built: memory budget": 3}
    assert len([r for r in caplog.records if "reached their memory budget" in r.getMessage()]) == 1
    assert len(auto_notices(caplog)) == 1  # "on" decides nothing


def test_a_new_run_decides_again(monkeypatch, caplog):
    size = plan_size(monkeypatch)
    model = model_of(True, seed=2, layers=2)
    args = block_args(model.blocks[0], PACKED, seed=3, new=True)
    hook = SparseAttentionHook(config())
    budgets = iter([2 * size, 2 * size - 1])
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            monkeypatch.setattr(plan_reuse, "memory_budget", lambda device, b=next(budgets): b)
            for step in (3, 4):  # sigma rises at the second run's first call: a new run
                args["transformer_options"] = options(step)
                run_model(model, hook, args, True)
    assert [n.split("auto: ")[1][:3] for n in auto_notices(caplog)] == ["on ", "off"]
    assert hook.tracker.plans.summary()["built"] == 0


def test_the_estimate_counts_sparse_blocks_and_head_groups(monkeypatch, caplog):
    with caplog.at_level(logging.INFO):
        sampled(monkeypatch, steps=(3,), layers=3, dense_layers=(1,), minimax_head_chunks=2)
    (notice,) = auto_notices(caplog)
    assert "(2 sparse blocks x 1 branch x 2 head groups = 4 plans of " in notice


def test_branches_are_those_the_run_showed_or_at_its_first_step_the_missing_one():
    first = " (the run's first step: the other of cond and uncond may follow as its own call)"
    assert branch_count({(0,): 0}, 0) == (2, first)  # cfg > 1 as two calls, or cfg 1: not known yet
    assert branch_count({(0,): 0}, 1) == (1, "")  # step 0 showed every branch: cfg 1
    assert branch_count({(0,): 0, (1,): 0}, 0) == (2, "")
    assert branch_count({(0,): 0, (1,): 0}, 2) == (2, "")
    assert branch_count({(1, 0): 0}, 0) == (1, "")  # both in one call: one slot holds both
    assert branch_count({(): None}, None) == (1, "")  # outside ComfyUI's CFG
    assert branch_count({(0,): None}, None) == (2, first)  # no sigmas: no earlier step known
    assert str(Estimate(50, 2, 1, first)) == f"50 sparse blocks x 2 branches{first} x 1 head group"


def test_a_second_shape_counts_what_the_first_keeps():
    store = PlanStore(budget_bytes=10 * GIB)

    def first_plan(shape: str, estimate: Estimate, size: int):
        key = ("cond", 0, shape, 0)
        slot = store.slot(key)
        store.expect(shape, estimate)
        store.count("first")  # what `PlanSlot.reusable` counted for its first call
        slot.size = size
        store.admit(slot, size, CPU)
        return key, slot

    key, slot = first_plan("A", Estimate(4, 1, 1), 2 * GIB)
    assert store.decide("A", key, slot, CPU, "A") == (
        "plan_reuse auto: on for the A shape: its kept plans need about 8.00 GiB (4 sparse blocks x 1 branch x "
        "1 head group = 4 plans of 2.00 GiB), within the memory budget of 10.00 GiB (the store's own budget)")
    for block in (1, 2, 3):
        assert store.admit(store.slot(("cond", block, "A", 0)), 2 * GIB, CPU)
    assert store.decide("A", key, slot, CPU, "A") is None and store.verdict("A")  # decided: nothing said again
    key, slot = first_plan("B", Estimate(3, 1, 1), GIB)
    assert store.used == {"cpu": 9 * GIB}  # the slot itself fits the budget; the run's need does not
    assert store.decide("B", key, slot, CPU, "B") == (
        "plan_reuse auto: off for the B shape: its kept plans would need about 11.00 GiB (3 sparse blocks x 1 branch "
        "x 1 head group = 3 plans of 1.00 GiB, plus 8.00 GiB kept for other shapes), past the memory budget of "
        "10.00 GiB (the store's own budget): every block plans afresh at every step, the memory stays with sampling "
        "(plan_reuse on keeps the plans that fit)")
    assert store.used == {"cpu": 8 * GIB} and key not in store.slots and store.counts == {"first": 1}
    assert store.verdict("B") is False
    slot_of_unknown = store.slot(("cond", 0, "D", 0))
    store.count("first")
    assert "the run's blocks, branches and head groups are not known here" in store.decide(
        "D", ("cond", 0, "D", 0), slot_of_unknown, CPU, "D")
    store.clear()
    assert store.verdict("A") is None and not store.expects("A")
