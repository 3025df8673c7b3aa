"""Routing: pooled scores, budgets, ties, index tables, scopes."""
import math

import pytest
import torch

from adaptive_sparse_attention import SequenceLayout, SparseConfig
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.backend.routing import index_table, pooled_scores, region_budget
from adaptive_sparse_attention.kernels.reference.planner_reference import topk_blocks
from adaptive_sparse_attention.backend.tiling import cube_tiling


def test_pooled_score_of_A_and_B_is_3_over_sqrt2():
    # D = 2; A's queries per time slice and B's keys per time slice, four tokens each
    qa = torch.tensor([[2.0, 0], [0, 2], [2, 2], [0, 0]]).repeat_interleave(4, 0)
    kb = torch.tensor([[1.0, 0], [1, 0], [3, 2], [3, 2]]).repeat_interleave(4, 0)
    e = pooled_scores(qa.mean(0).view(1, 1, 1, 2), kb.mean(0).view(1, 1, 1, 2))
    assert torch.allclose(e, torch.tensor(3 / math.sqrt(2)))


def test_budgets():
    assert region_budget(256, 1 - 0.75) == 64  # 256 blocks, 75% dropped
    assert region_budget(30, 0.1) == 3  # 0.1 * 30 must not round up to 4
    assert region_budget(7, 0.1) == 1  # at least one block
    assert region_budget(4, 1.0) == 4
    assert region_budget(1134, 0.1) == 114


def test_A_selects_B_and_D():
    scores = torch.tensor([[0.2, 3.1, -0.5, 2.4]])
    picked = topk_blocks(scores, 2)
    mask = torch.zeros(1, 4, dtype=torch.bool).scatter_(1, picked, True)
    assert mask.int().tolist() == [[0, 1, 0, 1]]
    idx, num = index_table(mask)
    assert idx.tolist() == [[1, 3, -1, -1]]
    assert num.tolist() == [2]


def test_ties_break_toward_the_lower_block_index():
    scores = torch.tensor([[1.0, 5.0, 5.0, 1.0, 5.0]])
    assert topk_blocks(scores, 2).tolist() == [[1, 2]]
    assert topk_blocks(scores, 4).tolist() == [[1, 2, 4, 0]]


def _layout_with_two_references():
    return SequenceLayout.from_segments([
        (0, 40, "text"), (40, 40 + 4 * 8 * 8, "ref_video", (4, 8, 8)), (296, 296 + 4 * 4 * 8, "ref_img", (4, 4, 8)),
        (424, 450, "audio"), (450, 450 + 8 * 8 * 8, "video", (8, 8, 8))])


@pytest.mark.parametrize("scope", ["target-video", "joint-video"])
def test_scopes_context_exact_and_one_budget_per_key_region(scope):
    torch.manual_seed(1)
    lay = _layout_with_two_references()
    q, k, v = (torch.randn(1, 2, lay.total, 32) for _ in range(3))
    ratio = 0.3
    plan = build_plan(q, k, v, lay, SparseConfig(topk_ratio=ratio, tiling="cube", sparse_scope=scope, tail="none"))
    t, kp = plan.tiling, plan
    J = t.num_blocks
    spans = dict(zip([s.kind + str(s.start) for s in t.regions], t.region_blocks))
    ctx_hi = t.blocks_of("context")[1]
    tgt = t.blocks_of("target_video")
    refs = [spans["ref_video40"], spans["ref_img296"]]
    sparse_rows = range(tgt[0], J) if scope == "target-video" else range(ctx_hi, J)
    groups = [tgt] if scope == "target-video" else refs + [tgt]
    assert [(lo, hi) for lo, hi, _ in plan.groups] == groups
    for i in range(J):
        if i not in sparse_rows:
            assert kp.dense_hi[i] == J
            assert (kp.q2k_num[..., i] == 0).all()  # dense query block
            continue
        assert kp.dense_hi[i] == (tgt[0] if scope == "target-video" else ctx_hi)  # context keys always exact
        for b, h in ((0, 0), (0, 1)):
            row = kp.q2k_idx[b, h, i, : kp.q2k_num[b, h, i]]
            assert torch.equal(row, row.sort().values)
            for lo, hi in groups:
                inside = ((row >= lo) & (row < hi)).sum().item()
                assert inside == region_budget(hi - lo, ratio)  # each key region keeps its own quota


def test_selection_is_the_topk_of_pooled_scores():
    torch.manual_seed(2)
    lay = SequenceLayout.from_segments([(0, 50, "text"), (50, 50 + 6 * 8 * 8, "video", (6, 8, 8))])
    q, k, v = (torch.randn(1, 1, lay.total, 16, dtype=torch.float64) for _ in range(3))
    plan = build_plan(q, k, v, lay, SparseConfig(topk_ratio=0.25, tiling="cube", tail="none"))
    perm = cube_tiling(lay, 64).q_perm.view(-1, 64)
    means = lambda x: torch.stack([x[0, 0, r[r >= 0]].mean(0) for r in perm])  # noqa: E731
    e = means(q) @ means(k).T / 4.0
    lo, hi = plan.tiling.blocks_of("target_video")
    for i in range(lo, hi):
        expect = sorted((torch.argsort(-e[i, lo:hi], stable=True)[: region_budget(hi - lo, 0.25)] + lo).tolist())
        assert plan.q2k_idx[0, 0, i].tolist() == expect


def test_route_plan_is_built_once_per_shape_and_ratio():
    """The shape-only tables are cached: a second plan of the same shape copies nothing from the
    host (on the GPU such a copy from pageable memory would wait for the device to drain)."""
    from adaptive_sparse_attention.backend.routing import route_plan
    from adaptive_sparse_attention.backend.tiling import cube_tiling

    lay = _layout_with_two_references()
    tiling = cube_tiling(lay, 64)
    first, groups = route_plan(tiling, "joint-video", 0.2, lay.cache)
    again, groups_again = route_plan(cube_tiling(lay, 64), "joint-video", 0.2, lay.cache)
    assert again is first
    assert groups_again == groups
    other, _ = route_plan(tiling, "joint-video", 0.3, lay.cache)
    assert other is not first
    assert route_plan(tiling, "joint-video", 0.2)[0] is not first  # without the layout's cache: built anew
    lay.cache.clear()
    assert route_plan(tiling, "joint-video", 0.2, lay.cache)[0] is not first
    assert isinstance(groups, tuple)
    assert all(type(g).__name__ == "RoutingGroup" for g in groups)  # immutable, shared
