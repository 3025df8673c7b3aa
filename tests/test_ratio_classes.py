"""Nothing measured during sampling: the sparse choice is keyed by a few ratio classes (`ratio_class`) that every
ratio the node runs maps to; `prepare` measures each class; a new ratio of a class met already costs neither a
kernel measurement nor a host synchronisation (CPU, stand-in candidates from `sparse_standins.py`)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from sparse_standins import StandIn, Timer, row

from adaptive_sparse_attention import SequenceLayout, SparseConfig, sparse_attention
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.bench.prepare import Rung, prepare
from adaptive_sparse_attention.bench.scenes import SceneSize
from adaptive_sparse_attention.kernels.dense.choice import DenseChoices
from adaptive_sparse_attention.kernels.sparse_choice import choice as sparse_choice
from adaptive_sparse_attention.kernels.sparse_choice.choice import (RATIO_CLASSES, ROWS_CAP, SparseChoices,
                                                                     ratio_class, rows_bucket)
from adaptive_sparse_attention.nodes import sparse_call
from adaptive_sparse_attention.nodes.error_target import CAP, FLOOR
from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook
from h3_block import block_args, layout_of
from h3_harness import PACKED, config, model_of

CLOSE = 1 + 2 ** -12  # within the bf16 bound at float32


def test_every_ratio_the_node_runs_maps_to_a_class_within_a_factor_of_sqrt2():
    """The widget's range (0.01 to 1: a ramp runs up to 1), the error target's floor to cap: each ratio's class
    is the nearest on a log scale; the classes are 0.0125 to 0.8, a factor of 2 apart."""
    assert RATIO_CLASSES == (0.0125, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8)
    assert [ratio_class(r) for r in (0.01, 0.05, 0.14, 0.15, 0.25, 0.28, 0.3, 0.5, 1.0)] == \
        [0.0125, 0.05, 0.1, 0.2, 0.2, 0.2, 0.4, 0.4, 0.8]
    assert {ratio_class(FLOOR), ratio_class(CAP)} == {0.05, 0.4}
    for step in range(1001):
        ratio = 0.01 * 100 ** (step / 1000)  # 0.01 to 1
        assert abs(math.log(ratio / ratio_class(ratio))) <= math.log(2) / 2 + 1e-12


def plan_of(ratio: float):
    layout = SequenceLayout.from_segments([(0, 70, "text"), (70, 70 + 5 * 8 * 9, "video", (5, 8, 9))])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, layout.total, 32, generator=g)
    return q, build_plan(q, q, q, layout, SparseConfig(topk_ratio=ratio, tiling="cube"))


def test_two_ratios_of_one_class_share_a_key_and_the_rows_bucket_stops_at_the_cap():
    choices = SparseChoices()
    (q, a), (_, b), (_, c) = plan_of(0.15), plan_of(0.25), plan_of(0.1)
    assert choices.key(q, a, "bf16", 0.15) == choices.key(q, b, "bf16", 0.25)
    assert choices.key(q, a, "bf16", 0.15) != choices.key(q, c, "bf16", 0.1)
    assert "ratio class 0.2 " in choices.key(q, a, "bf16", 0.15)
    assert [rows_bucket(n) for n in (1, 430, 512, 513, 40_000, 398_783)] == [1, 512, 512, 1024, ROWS_CAP, ROWS_CAP]


def standins(monkeypatch):
    a, b = StandIn("a", CLOSE), StandIn("b", 2 - CLOSE)
    monkeypatch.setattr(sparse_choice, "SPARSE_KERNELS", (row(a), row(b)))
    monkeypatch.setattr(SparseChoices, "describe_device", lambda self, device: "pack|a GPU|sm90")
    return a, b


def test_prepare_measures_every_class_once_per_row_bucket_and_a_later_run_measures_none(monkeypatch, tmp_path):
    """Three shapes in two row buckets: every class at both bounds for each bucket (28 entries), measured at the
    bucket's first shape only; a later process then runs any ratio from 0.01 to 1 at both bounds timing nothing
    (the saved choice is checked once a class)."""
    a, b = standins(monkeypatch)
    path = tmp_path / "sparse.json"
    shapes = [Rung(f"{t} frames", SceneSize(8, 8, (t, 4, 4), 2, 32)) for t in (3, 4, 6)]  # 64, 80, 112 rows
    assert [rows_bucket(r.size.total) for r in shapes] == [64, 128, 128]
    timer = Timer([a, b], {"a": 2.0, "b": 1.0})
    result = prepare(shapes, torch.device("cpu"), torch.float32, SparseConfig(kernel="auto"),
                     DenseChoices(tmp_path / "dense.json"), echo=lambda line: None,
                     sparse_choices=SparseChoices(path, timer=timer, persist=True), budget=lambda: 1 << 40)
    assert ["sparse_s" in r for r in result.values()] == [True, True, False]
    saved = json.loads(path.read_text())
    assert len(saved) == 2 * len(RATIO_CLASSES) * 2 and set(saved.values()) == {"b,a"}
    assert {key.split("ratio class ")[1].split()[0] for key in saved} == {f"{c:g}" for c in RATIO_CLASSES}

    later = SparseChoices(path, timer=lambda fn: pytest.fail("a kernel was measured during the run"), persist=True)
    size = shapes[2].size
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, size.total, 32, generator=g) for _ in range(3))
    for ratio in (0.01, 0.03, 0.07, 0.15, 0.33, 0.5, 0.7, 1.0):
        for precision in ("bf16", "8-bit"):
            config = SparseConfig(kernel="auto", topk_ratio=ratio, precision=precision)
            _, info = sparse_attention(q, k, v, size.layout(), config, return_info=True, choices=later)
            assert info.kernel == "b"


def test_a_new_ratio_of_a_known_class_costs_no_measurement_and_no_host_sync(monkeypatch):
    """The node's sparse calls at 0.15 (the class's first: the density read and the kernel choice, then a call
    timed against dense), then 0.25 (the same class: the plain call) and 0.1 (a new class: read and chosen)."""
    standins(monkeypatch)
    synced, chosen, timed = [], [], []
    real_attention, real_first_use = sparse_call.sparse_attention, SparseChoices.first_use
    monkeypatch.setattr(sparse_call, "sparse_attention", lambda *a, return_info=False, **kw: (
        synced.append(a[4].topk_ratio) if return_info else None) or real_attention(*a, return_info=return_info, **kw))
    monkeypatch.setattr(SparseChoices, "first_use", lambda self, key, *a: chosen.append(a[-1]) or real_first_use(
        self, key, *a))
    real_timed = sparse_call.timed_against_dense
    monkeypatch.setattr(sparse_call, "timed_against_dense", lambda tracker, key, *a, **kw: (
        timed.append(key[1]), real_timed(tracker, key, *a, **kw))[1])  # key: (layout signature, ratio class)
    model = model_of(True, seed=3, layers=1)
    args = block_args(model.blocks[0], PACKED, seed=4, new=True)
    hook = SparseAttentionHook(config(kernel="auto"))
    for ratio in (0.15, 0.15, 0.25, 0.25, 0.1):
        token = (5, layout_of(PACKED), hook.engine_config.replace(topk_ratio=ratio), (), (None, None))
        hook.attend(0, token, model.blocks[0].attn, args["img"].clone(), args["rope_freqs"], {}, None)
    assert synced == [0.15, 0.1] and chosen == [0.15, 0.1] and timed == [ratio_class(0.15)] == [0.2]
