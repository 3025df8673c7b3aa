"""The tiling-ceiling probe (bench/tiling_ceiling.py) measures what the shipped choice picks from,
and where a tiling loses recall.

The shipped reblock tiling takes, per head, the tree or one of its tubes; the probe builds those
candidates itself, so on every head the shipped recall must equal one of theirs exactly (a tube
cut differently, or another metric, would break that), and the ceilings must order as their
candidate sets nest. The loss stages are nested upper bounds, and the last one is the recall the
metrics module reports for the same rows.
"""
import json

import pytest
import torch

from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.bench.metrics import plan_mass_metrics, sample_rows
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.backend.reblock import reblock_tiling
from adaptive_sparse_attention.bench.scenes import SceneSize, make_scene
from adaptive_sparse_attention.backend.layout import SequenceLayout
from adaptive_sparse_attention.backend.tiling import cube_tiling
from adaptive_sparse_attention.bench import tiling_ceiling
from adaptive_sparse_attention.bench.cli import main


def test_shipped_choice_is_one_of_the_probed_candidates_per_head():
    sc = make_scene("cuts", SceneSize(64, 30, (24, 8, 12), 4, 128), seed=1)
    recalls = tiling_ceiling.per_head_recalls(sc)
    shipped = recalls["reblock (shipped)"]
    for h in range(4):
        assert any(float(recalls[c][h]) == float(shipped[h]) for c in tiling_ceiling.SHIPPED_SET), h
    c = tiling_ceiling.ceilings(recalls)
    assert torch.all(c["best of shipped candidates"] >= shipped)
    assert torch.all(c["best with query/key pairings"] >= c["best of tree + tubes + cubes"])
    assert float(c["best of shipped candidates"].mean()) > float(c["cube (4, 4, 4)"].mean())


def test_loss_stages_are_nested_bounds_of_the_routed_recall():
    sc = make_scene("cuts", SceneSize(40, 24, (9, 8, 12), 3, 64), seed=2)  # edge blocks in video and context
    for tiling in (reblock_tiling(sc.q, sc.k, sc.layout, 64), cube_tiling(sc.layout, 64)):
        stages = [tiling_ceiling.recall_losses(sc, tiling)[name] for name in tiling_ceiling.STAGES]
        for upper, lower in zip(stages, stages[1:]):
            assert torch.all(upper >= lower - 1e-6)
        assert float(stages[0].mean()) > float(stages[-1].mean()) + 0.05  # the bounds are not all equal
    full = tiling_ceiling.recall_losses(sc, tiling, ratio=1.0)
    for r in full.values():
        torch.testing.assert_close(r, torch.ones_like(r), rtol=0, atol=1e-5)


def test_routed_stage_is_the_metrics_recall_of_the_same_rows():
    sc = make_scene("pan", SceneSize(40, 24, (9, 8, 12), 2, 64), seed=3)
    tiling = cube_tiling(sc.layout, 64)  # one permutation for every head, so the rows are shared
    plan = build_plan(sc.q, sc.k, sc.v, sc.layout, SparseConfig(topk_ratio=0.1, tail="none", min_tokens=0),
                      tiling=tiling)
    rows = sample_rows(sc.layout, 64, 0)["video"]
    perm = tiling.q_perm[0, 0]
    slot = torch.empty(sc.layout.total, dtype=torch.long)
    slot[perm[perm >= 0].long()] = torch.nonzero(perm >= 0).flatten()
    members = perm.view(-1, 64)[slot[rows] // 64].reshape(-1)  # every row of the sampled rows' blocks
    members = members[members >= 0].long()
    recall, _ = plan_mass_metrics(sc.q, sc.k, plan, members)
    routed = tiling_ceiling.recall_losses(sc, tiling)["routed"]
    torch.testing.assert_close(routed, recall[0].mean(-1).double(), rtol=0, atol=1e-5)


def test_cli_writes_every_ceiling_and_loss(tmp_path, capsys):
    out = tmp_path / "ceiling.json"
    assert main(["tiling-ceiling", "--preset", "demo", "--scene", "pan", "--out", str(out)]) == 0
    result = json.loads(out.read_text())["scenes"]["pan"]
    assert set(result["losses"]) == {"cube (4, 4, 4)", "tree", "reblock (shipped)"}
    assert all(set(stages) == set(tiling_ceiling.STAGES) for stages in result["losses"].values())
    assert result["losses"]["cube (4, 4, 4)"]["routed"]["gain_points"] == 0.0
    rows = result["ceilings"]
    assert set(rows) == {"cube (4, 4, 4)", "tree", "reblock (shipped)", "best of shipped candidates",
                         "best of tree + all tubes", "best of tree + tubes + cubes", "best with query/key pairings"}
    assert rows["cube (4, 4, 4)"]["gain_points"] == 0.0
    assert "demo pan best of shipped candidates" in capsys.readouterr().out


def test_cube_shapes_are_tiles_of_the_block_volume():
    lay = SequenceLayout.from_segments([(0, 10, "text"), (10, 10 + 5 * 6 * 7, "video", (5, 6, 7))])
    tube = tiling_ceiling.cube_shape_tiling(lay, (16, 2, 2))
    members = tube.k_perm.view(-1, 64)[tube.region_blocks[-1][0]]
    rows = members[members >= 0] - 10  # the first tube: 5 frames (the grid has 5) x 2 x 2
    t, y, x = rows // 42, rows % 42 // 7, rows % 7
    assert rows.numel() == 20
    assert t.unique().numel() == 5
    assert y.max() <= 1
    assert x.max() <= 1
    shipped = tiling_ceiling.cube_shape_tiling(lay, (4, 4, 4))
    assert torch.equal(shipped.k_perm, cube_tiling(lay, 64).k_perm)
    for bad in ((4, 4, 8), (64, 1), (0, 8, 8)):
        with pytest.raises(ValueError, match="tile="):
            tiling_ceiling.cube_shape_tiling(lay, bad)
