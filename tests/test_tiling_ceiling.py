"""The tiling-ceiling probe (bench/tiling_ceiling.py) measures what the shipped choice picks from.

The shipped reblock tiling takes, per head, the tree or one of its tubes; the probe builds those
candidates itself, so on every head the shipped recall must equal one of theirs exactly (a tube
cut differently, or another metric, would break that), and the ceilings must order as their
candidate sets nest.
"""
import json
import sys

import torch

from adaptive_sparse_attention.backend.scenes import SceneSize, make_scene
from adaptive_sparse_attention.bench import tiling_ceiling


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


def test_cli_writes_every_ceiling(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ceiling.json"
    monkeypatch.setattr(sys, "argv", ["tiling_ceiling", "--preset", "demo", "--scene", "pan", "--out", str(out)])
    tiling_ceiling.main()
    rows = json.loads(out.read_text())["scenes"]["pan"]["ceilings"]
    assert set(rows) == {"cube (4, 4, 4)", "tree", "reblock (shipped)", "best of shipped candidates",
                         "best of tree + all tubes", "best of tree + tubes + cubes", "best with query/key pairings"}
    assert rows["cube (4, 4, 4)"]["gain_points"] == 0.0
    assert "demo pan best of shipped candidates" in capsys.readouterr().out
