"""Plans reused across evaluated steps (backend/plan_reuse.py, the planner's `slot`): the rule, the
check, the store's bound and counts, the run tracker that owns the store, and the error bound on a
drifting scene (bench/steps.py)."""
from __future__ import annotations

import pytest
import torch

from adaptive_sparse_attention import SparseConfig, sparse_attention
from adaptive_sparse_attention.backend.plan_reuse import (DRIFT_LIMIT, MEMORY_SHARE, OTHER_DEVICE_BYTES, PlanStore,
                                                          drift, held_bytes, memory_budget)
from adaptive_sparse_attention.backend.planner import build_plan, make_tiling
from adaptive_sparse_attention.kernels.plan import Tiling
from adaptive_sparse_attention.bench.scenes import make_scene
from adaptive_sparse_attention.bench.steps import REUSE_BOUND, reuse_rows, simple_sigmas
from adaptive_sparse_attention.nodes.run_tracker import RunTracker

CFG = SparseConfig(topk_ratio=0.2, min_tokens=0, kernel="torch", tiling="cube")  # reblock: where the tiling matters


@pytest.fixture(scope="module")
def scene():
    return make_scene("pan", "demo", noise=0.5)


def same_plan(a, b) -> bool:
    return (torch.equal(a.q_perm, b.q_perm) and torch.equal(a.k_perm, b.k_perm) and torch.equal(a.q2k_idx, b.q2k_idx)
            and torch.equal(a.q2k_num, b.q2k_num))


def test_the_next_step_reuses_the_tiling_and_routing_and_the_output_is_the_fresh_one(scene):
    store = PlanStore()
    slot = store.slot(("cond", 0))
    cfg = CFG.replace(tiling="reblock")
    first = build_plan(scene.q, scene.k, scene.v, scene.layout, cfg, slot=slot)
    again = build_plan(scene.q, scene.k, scene.v, scene.layout, cfg, slot=slot)
    assert again.tiling is first.tiling and again.q2k_idx is first.q2k_idx  # kept, not rebuilt
    fresh = sparse_attention(scene.q, scene.k, scene.v, scene.layout, cfg)
    kept = sparse_attention(scene.q, scene.k, scene.v, scene.layout, cfg, plan_slot=slot)
    torch.testing.assert_close(kept, fresh, rtol=0, atol=0)
    assert store.summary() == {"reused": 2, "built": 1, "rebuilds": 0, "built: first": 1}


def test_a_shape_or_setting_change_rebuilds(scene):
    store = PlanStore()
    slot = store.slot("block")
    build_plan(scene.q, scene.k, scene.v, scene.layout, CFG, slot=slot)
    build_plan(scene.q, scene.k, scene.v, scene.layout, CFG.replace(topk_ratio=0.3), slot=slot)  # a ramped step
    half = [t[:, :1] for t in (scene.q, scene.k, scene.v)]
    plan = build_plan(*half, scene.layout, CFG.replace(topk_ratio=0.3), slot=slot)  # another head count
    assert plan.q_perm.shape[1] == 1
    assert store.summary() == {"reused": 0, "built": 3, "rebuilds": 2, "built: first": 1,
                               "built: shape or settings changed": 2}
    with pytest.raises(ValueError, match="a tiling or a plan slot"):
        build_plan(scene.q, scene.k, scene.v, scene.layout, CFG, tiling=make_tiling(scene.q, scene.k, scene.layout, CFG),
                   slot=slot)


def test_moved_statistics_rebuild_at_the_next_step_and_small_moves_do_not(scene):
    store = PlanStore()
    slot = store.slot("block")
    moved = make_scene("pan", "demo", noise=0.1)  # far along the trajectory: the block means moved a lot
    near = make_scene("pan", "demo", noise=0.499)  # a hair: well inside the limit
    build_plan(scene.q, scene.k, scene.v, scene.layout, CFG, slot=slot)
    build_plan(near.q, near.k, near.v, near.layout, CFG, slot=slot)  # reused; the check passes
    build_plan(near.q, near.k, near.v, near.layout, CFG, slot=slot)  # reused
    assert store.summary()["reused"] == 2
    build_plan(moved.q, moved.k, moved.v, moved.layout, CFG, slot=slot)  # reused (decided one step ago); fails now
    fresh = build_plan(moved.q, moved.k, moved.v, moved.layout, CFG)
    rebuilt = build_plan(moved.q, moved.k, moved.v, moved.layout, CFG, slot=slot)
    assert same_plan(rebuilt, fresh)
    assert store.summary() == {"reused": 3, "built": 2, "rebuilds": 1, "built: first": 1, "built: statistics moved": 1}


def test_drift_is_the_worst_relative_change_of_the_block_means():
    ref = torch.ones(1, 2, 4, 3)
    now = ref.clone()
    now[0, 1, 2] += 0.5  # one block of head 1 of Q moved
    assert float(drift(now, ref, ref, ref, (0, 4))) == pytest.approx(0.5 * 3 ** 0.5 / (12 ** 0.5))
    assert float(drift(now, ref, ref, ref, (0, 2))) == 0.0  # outside the sparse span: not counted
    assert float(drift(ref, ref, ref, ref, (0, 4))) == 0.0


def test_the_store_is_bounded_and_a_run_end_drops_the_plans_not_the_counts(scene):
    store = PlanStore(bound=2)
    for key in "abc":
        build_plan(scene.q, scene.k, scene.v, scene.layout, CFG, slot=store.slot(key))
    assert list(store.slots) == ["b", "c"]
    store.drop_plans()
    assert not store.slots and store.summary()["built"] == 3
    store.clear()
    assert store.summary() == {"reused": 0, "built": 0, "rebuilds": 0}


def test_plans_past_the_memory_budget_are_used_not_kept_and_said_once(scene, caplog):
    """The store keeps plans within its byte budget: a plan past it runs its step, is not kept, and its
    slot plans afresh next time (counted as such, not as a rebuild); nothing is evicted on the way."""
    sizer = PlanStore(budget_bytes=1 << 40)
    build_plan(scene.q, scene.k, scene.v, scene.layout, CFG, slot=sizer.slot("a"))
    one = sizer.used["cpu"]
    q = scene.q
    J = sizer.slots["a"].kept.q2k_idx.shape[2]
    assert one >= 2 * q.shape[0] * q.shape[1] * J * q.shape[-1] * 2  # at least the bf16 block means of Q and K
    store = PlanStore(budget_bytes=one + one // 2)  # room for one plan
    slots = [store.slot(key) for key in "ab"]
    for _ in range(3):  # three steps of two blocks
        plans = [build_plan(scene.q, scene.k, scene.v, scene.layout, CFG, slot=slot) for slot in slots]
        assert same_plan(plans[1], build_plan(scene.q, scene.k, scene.v, scene.layout, CFG))
    assert slots[0].kept is not None and slots[1].kept is None and store.used == {"cpu": one} and slots[0].bytes == one
    assert store.summary() == {"reused": 2, "built": 4, "rebuilds": 0, "built: first": 2, "built: memory budget": 2}
    said = [r for r in caplog.records if "memory budget" in r.getMessage()]
    assert len(said) == 1 and "plan afresh at every step" in said[0].getMessage()
    tracker = RunTracker("adaptive sparse attention")
    tracker.plans = store
    tracker.note_block(0, sparse=True, density=0.3)
    assert "plans reused 2, built 4 (0 rebuilds, 2 past the plans' memory budget)" in tracker.summary()
    store.drop_plans()
    assert store.used == {"cpu": 0} and slots[0].kept is None and slots[0].bytes == 0
    build_plan(scene.q, scene.k, scene.v, scene.layout, CFG, slot=store.slot("b"))  # room again
    assert store.used == {"cpu": one}
    store.clear()
    assert store.used == {"cpu": 0}


def test_each_device_has_its_own_budget():
    """A store that serves clones on two devices (ComfyUI's multi-GPU threads) gives each its own budget."""
    store = PlanStore(budget_bytes=100)
    a, b, c = (store.slot(key) for key in "abc")
    assert store.admit(a, 80, torch.device("cpu")) and store.admit(b, 80, torch.device("meta"))
    assert not store.admit(c, 80, torch.device("cpu"))
    assert store.used == {"cpu": 80, "meta": 80}
    assert store.admit(a, 90, torch.device("cpu")) and store.used["cpu"] == 90  # a slot's new plan replaces its own


def test_held_bytes_counts_a_shared_storage_once():
    perm = torch.zeros(2, 3, 64, dtype=torch.int32)
    assert held_bytes(perm, perm, perm[:, :1]) == perm.nbytes
    assert held_bytes(perm, perm.clone()) == 2 * perm.nbytes


def test_the_budget_is_a_share_of_the_gpus_memory(monkeypatch):
    """A fixed share of the GPU's total memory (the same bits run to run, whatever is free), a fixed size
    elsewhere; a negative budget is refused by name."""
    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    assert memory_budget(torch.device("cuda", 0)) == int(80 * 2**30 * MEMORY_SHARE) == 4 * 2**30
    assert memory_budget(torch.device("cpu")) == OTHER_DEVICE_BYTES
    with pytest.raises(ValueError, match="budget_bytes=-1 must be >= 0 or None"):
        PlanStore(budget_bytes=-1)


def test_the_run_tracker_owns_the_store_and_reports_it(scene):
    tracker = RunTracker("adaptive sparse attention")
    slot = tracker.plans.slot("block")
    build_plan(scene.q, scene.k, scene.v, scene.layout, CFG, slot=slot)
    build_plan(scene.q, scene.k, scene.v, scene.layout, CFG, slot=slot)
    tracker.note_block(0, sparse=True, density=0.3)
    assert tracker.report()["plans"] == {"reused": 1, "built": 1, "rebuilds": 0, "built: first": 1}
    assert "plans reused 1, built 1 (0 rebuilds)" in tracker.summary()
    tracker.finish()
    assert not tracker.plans.slots and tracker.report()["plans"]["built"] == 0


def tiny_plan() -> tuple[Tiling, torch.Tensor, torch.Tensor]:
    """A tiling of 4 one-row blocks and an empty routing: what a slot keeps beside the means."""
    perm = torch.arange(4, dtype=torch.int32).view(1, 1, 4)
    return (Tiling(1, perm, perm, torch.ones(4, dtype=torch.int32)), torch.zeros(1, 1, 4, 1, dtype=torch.int16),
            torch.zeros(1, 1, 4, dtype=torch.int32))


def verdict_after(sigmas: list[tuple[float | None, float | None]], drifts: list[float], limit: float = 0.08) -> bool:
    """The slot's verdict (rebuild?) after a build at sigmas[0] and checks at the later sigmas, where each
    check's block means have moved by drifts[i] (relative) from the build's."""
    slot = PlanStore(drift_limit=limit).slot("block")
    ones = torch.ones(1, 1, 4, 8)
    slot.at(*sigmas[0])
    slot.keep(("facts",), *tiny_plan(), ones, ones)
    for at, d in zip(sigmas[1:], drifts):
        slot.at(*at)
        slot.check(ones * (1 + d), ones, (0, 4))
    return bool(slot.verdict[0])


def test_a_verdict_the_device_has_not_reached_is_waited_for_not_taken_as_failed():
    """The decision never depends on timing: an unreached verdict (the host a step ahead) is waited for."""
    class Event:
        reached = False

        def query(self):
            return self.reached

        def synchronize(self):
            self.reached = True

    ones = torch.ones(1, 1, 4, 8)
    for moved in (False, True):
        store = PlanStore()
        slot = store.slot("block")
        slot.keep(("facts",), *tiny_plan(), ones, ones)
        event = Event()
        slot.verdict = (torch.tensor(moved), event)
        assert (slot.reusable(("facts",)) is None) is moved and event.reached
        assert store.summary()["reused" if not moved else "built: statistics moved"] == 1


def test_the_check_predicts_the_next_drift_over_the_schedules_next_sigma_gap():
    # built at 0.95, checked at 0.90 with drift 0.03: 0.6 per unit of sigma; the next gap decides
    assert verdict_after([(0.95, 0.90), (0.90, 0.87)], [0.03]) is False  # 0.03 + 0.6 x 0.03 = 0.048
    assert verdict_after([(0.95, 0.90), (0.90, 0.78)], [0.03]) is True  # 0.03 + 0.6 x 0.12 = 0.102
    # without sigmas every gap is a step: 0.03 + 0.03 = 0.06, whatever comes next
    assert verdict_after([(None, None), (None, None)], [0.03]) is False
    assert verdict_after([(None, None), (None, None)], [0.03], limit=0.05) is True
    # a rebuilt plan carries the rate: 0.6 over a next gap of 0.15 alone passes 0.08
    slot = PlanStore().slot("block")
    ones = torch.ones(1, 1, 4, 8)
    for at, build in (((0.95, 0.90), True), ((0.90, 0.85), False), ((0.85, 0.70), True)):
        slot.at(*at)
        if build:
            slot.keep(("facts",), *tiny_plan(), ones, ones)
        else:
            slot.check(ones * 1.03, ones, (0, 4))
    assert bool(slot.verdict[0]) is True


def test_the_tracker_gives_the_schedules_next_sigma():
    tracker = RunTracker("t")
    assert tracker.next_sigma(None) is None
    tracker.step_of({"sample_sigmas": torch.tensor([1.0, 0.9, 0.5, 0.0]), "sigmas": torch.tensor([0.9])})
    assert tracker.next_sigma(float(torch.tensor(0.9))) == pytest.approx(0.5)
    assert tracker.next_sigma(0.5) == 0.0 and tracker.next_sigma(1.0) == pytest.approx(0.9)


def test_reused_plans_stay_within_the_bound_of_fresh_ones_along_a_trajectory():
    """The bench's rule on a small drifting scene: every sparse step of an 8-step shift-3 schedule,
    reused-plan error within REUSE_BOUND of a fresh plan's (bench/steps.py runs the CPU and GPU sizes)."""
    cache = {}

    def scene_at(sigma):
        if sigma not in cache:
            s = make_scene("cuts", "demo", noise=sigma)
            cache[sigma] = (s.q, s.k, s.v, s.layout, torch.nn.functional.scaled_dot_product_attention(s.q, s.k, s.v))
        return cache[sigma]

    sigmas = list(enumerate(simple_sigmas(6, 3.0)))[2:]
    rows, counts = reuse_rows(scene_at, sigmas, CFG.replace(topk_ratio=0.1))
    assert counts["reused"] >= 1 and counts["built"] + counts["reused"] == len(sigmas)
    assert max(r["reused"] / r["fresh"] for r in rows) <= REUSE_BOUND


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_verdict_comes_back_without_a_host_sync_on_cuda(scene):
    q, k, v = (t.cuda() for t in (scene.q, scene.k, scene.v))
    store = PlanStore()
    slot = store.slot("block")
    cfg = CFG.replace(kernel="auto")
    for _ in range(3):
        build_plan(q, k, v, scene.layout, cfg, slot=slot)
    flag, event = slot.verdict
    assert flag.is_pinned() and event is not None
    torch.cuda.synchronize()
    assert store.summary()["reused"] == 2 and not bool(flag) and DRIFT_LIMIT > 0
