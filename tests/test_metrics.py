"""Quality metrics against hand-computed cases (float64, so 1e-12 only absorbs summation order)."""
import math

import pytest
import torch

from adaptive_sparse_attention import SequenceLayout, SparseConfig, sparse_attention
from adaptive_sparse_attention.bench.metrics import (block_of_rows, output_errors, plan_mass_metrics, quality_report,
                                                       row_groups, sample_rows)
from adaptive_sparse_attention.kernels import BlockSparsePlan, BlockSummaries, QuerySummaries, Tiling

TOL = 1e-12


def test_relative_l2_and_cosine_by_hand():
    """Two target-video rows: ref rows (1, 0), (0, 1); out rows (1, 1), (0, 1); text rows equal."""
    layout = SequenceLayout.from_segments([(0, 1, "text"), (1, 3, "video", (1, 1, 2))])
    ref = torch.tensor([[[[3.0, 4.0], [1.0, 0.0], [0.0, 1.0]]]])
    out = torch.tensor([[[[3.0, 4.0], [1.0, 1.0], [0.0, 1.0]]]])
    errors = output_errors(out, ref, layout)
    assert errors["video"]["rel_l2"] == pytest.approx(1 / math.sqrt(2), abs=TOL)
    assert errors["video"]["cosine"] == pytest.approx((1 / math.sqrt(2) + 1) / 2, abs=TOL)
    assert errors["text"] == {"rel_l2": 0.0, "cosine": pytest.approx(1.0, abs=TOL)}


def test_block_of_rows_inverts_the_permutation():
    perm = torch.tensor([[[2, 0, -1, 1]]], dtype=torch.int32)  # block 0 = rows 2, 0; block 1 = row 1 + padding
    assert block_of_rows(perm, 2, 3).tolist() == [[[0, 1, 0]]]


def two_block_plan(tail: str) -> BlockSparsePlan:
    """Rows 0-1 form block 0 (dense: every key), rows 2-3 block 1 (exact on block 0 only, block 1
    unselected and, with a tail, summarised by key 1.0 with bias 0.5 or block log-mass 3.0)."""
    perm = torch.arange(4, dtype=torch.int32).view(1, 1, 4)
    summaries = None
    if tail == "query":
        summaries = QuerySummaries(torch.tensor([[[[0.0], [1.0]]]], dtype=torch.float64),
                                   torch.zeros(1, 1, 2, 1, dtype=torch.float64),
                                   torch.tensor([[[0.0, 0.5]]], dtype=torch.float64))
    elif tail == "block":
        summaries = BlockSummaries(torch.tensor([[[float("-inf"), 3.0]]], dtype=torch.float64),
                                   torch.zeros(1, 1, 2, 1, dtype=torch.float64))
    return BlockSparsePlan(Tiling(2, perm, perm, torch.tensor([2, 2], dtype=torch.int32)),
                           torch.tensor([2, 1], dtype=torch.int32), torch.full((1, 1, 2, 1), -1, dtype=torch.int32),
                           torch.zeros(1, 1, 2, dtype=torch.int32), tail=summaries)


@pytest.mark.parametrize("tail", ["none", "query", "block"])
def test_mass_recall_and_logmass_error_by_hand(tail):
    # D = 1 so the scale is 1 and the logits are plain products
    q = torch.tensor([1.0, 0.0, 1.0, 2.0], dtype=torch.float64).view(1, 1, 4, 1)
    k = torch.tensor([0.0, 1.0, 2.0, -1.0], dtype=torch.float64).view(1, 1, 4, 1)
    recall, err = plan_mass_metrics(q, k, two_block_plan(tail), torch.tensor([0, 3]))
    # row 3: logits 0, 2, 4, -2; exact keys are 0 and 1
    z = math.exp(0) + math.exp(2) + math.exp(4) + math.exp(-2)
    assert recall[0, 0, 0].item() == pytest.approx(1.0, abs=TOL)  # dense block
    assert recall[0, 0, 1].item() == pytest.approx((1 + math.exp(2)) / z, abs=TOL)
    if tail == "none":
        assert err is None
        return
    true_tail = math.log(math.exp(4) + math.exp(-2))
    estimate = 2 * 1.0 + 0.5 if tail == "query" else 3.0
    assert math.isnan(err[0, 0, 0].item())  # a dense row has nothing summarised
    assert err[0, 0, 1].item() == pytest.approx(estimate - true_tail, abs=TOL)


def test_row_groups_and_sampling():
    layout = SequenceLayout.from_segments([(0, 5, "text"), (5, 9, "audio"), (9, 9 + 2 * 3 * 4, "video", (2, 3, 4))])
    groups = row_groups(layout)
    assert list(groups) == ["text", "audio", "video"]
    assert groups["audio"].tolist() == [5, 6, 7, 8]
    a, b = sample_rows(layout, 3, seed=1), sample_rows(layout, 3, seed=1)
    assert all(torch.equal(a[g], b[g]) for g in a)
    assert a["audio"].numel() == 3
    assert set(a["audio"].tolist()) <= {5, 6, 7, 8}
    assert sample_rows(layout, 100)["text"].tolist() == [0, 1, 2, 3, 4]


def test_output_errors_per_group():
    layout = SequenceLayout.from_segments([(0, 2, "text"), (2, 2 + 1 * 1 * 2, "video", (1, 1, 2))])
    ref = torch.ones(1, 1, 4, 2, dtype=torch.float64)
    out = ref.clone()
    out[0, 0, 3] = torch.tensor([1.0, -1.0])  # one video row: error norm 2 of ref norm 2 (2 rows)
    errors = output_errors(out, ref, layout)
    assert errors["text"] == {"rel_l2": 0.0, "cosine": pytest.approx(1.0, abs=TOL)}
    assert errors["video"]["rel_l2"] == pytest.approx(2 / 2, abs=TOL)
    assert errors["video"]["cosine"] == pytest.approx(0.5, abs=TOL)  # rows with cos 1 and 0


def awkward_inputs(seed=0):
    layout = SequenceLayout.from_segments([(0, 37, "text"), (37, 90, "audio"), (90, 90 + 5 * 6 * 7, "video", (5, 6, 7))])
    g = torch.Generator().manual_seed(seed)
    return layout, [torch.randn(1, 2, layout.total, 32, generator=g, dtype=torch.float64) for _ in range(3)]


def test_context_rows_exact_and_full_ratio_recall_is_one():
    layout, (q, k, v) = awkward_inputs()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    rows = sample_rows(layout, 20)
    for ratio, tail in ((0.2, "reweight"), (1.0, "none")):
        cfg = SparseConfig(topk_ratio=ratio, tiling="cube", tail=tail)
        out, info = sparse_attention(q, k, v, layout, cfg, return_info=True)
        report = quality_report(q, k, layout, out, ref, info.plan, rows)
        for group in ("text", "audio"):
            assert report[group]["rel_l2"] < 1e-12
            assert report[group]["recall"] == pytest.approx(1.0, abs=TOL)
        if ratio == 1.0:
            assert report["video"]["recall"] == pytest.approx(1.0, abs=TOL)
            assert report["video"]["rel_l2"] < 1e-12
        else:
            assert 0.2 < report["video"]["recall"] < 1.0
            assert report["video"]["logmass_err"] > 0


def test_recall_matches_an_independent_dense_mask():
    """Recall against a token mask built independently from the cube members of the layout."""
    layout, (q, k, _) = awkward_inputs(seed=3)
    cfg = SparseConfig(topk_ratio=0.3, tiling="cube", tail="none")
    _, info = sparse_attention(q, k, k, layout, cfg, return_info=True)
    kp = info.plan
    rows = torch.arange(90, layout.total, 17)
    recall, _ = plan_mass_metrics(q, k, kp, rows)
    perm = kp.q_perm[0, 0].tolist()
    block = {row: slot // kp.block_size for slot, row in enumerate(perm) if row >= 0}
    allowed = kp.allowed_mask()[0]
    for h in range(2):
        p = torch.softmax(q[0, h, rows] @ k[0, h].T / math.sqrt(32), -1)
        for n, r in enumerate(rows.tolist()):
            keep = [c for c in range(layout.total) if allowed[h, block[r], block[c]]]
            assert recall[0, h, n].item() == pytest.approx(p[n, keep].sum().item(), abs=TOL)
