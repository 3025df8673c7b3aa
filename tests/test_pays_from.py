"""Sizes too small for sparse attention to pay: the crossover `prepare` measures, and what the node says.

The crossover is measured (here on the CPU with the torch kernel, as `prepare` does on a GPU),
saved with the dense choices and read back by the node, which says once at WARNING and in the
report when a run's size is below min_tokens or below that crossover, with the figure or with
the fact that it is not measured.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from comfyui_harness import SPARSE, comfy, needs_comfyui, sample, sparse  # noqa: F401 (comfy is a fixture)

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.kernels.dense.choice import DenseChoices
from adaptive_sparse_attention.kernels.dense import pays_from


def test_crossover_is_the_smallest_length_from_which_sparse_stays_faster():
    assert pays_from.crossover([(1000, 5.0, 4.0), (4000, 9.0, 10.0), (2000, 6.0, 6.5), (8000, 12.0, 30.0)]) == "2000"
    # a faster rung below a slower one does not count: it must pay at every longer rung too
    assert pays_from.crossover([(1000, 3.0, 4.0), (2000, 7.0, 6.5), (4000, 9.0, 10.0)]) == "4000"
    assert pays_from.crossover([(1000, 5.0, 4.0), (2000, 9.0, 6.0)]) == ">2000"
    with pytest.raises(ValueError, match="no timings"):
        pays_from.crossover([])


def test_what_a_saved_value_says_at_a_size():
    assert pays_from.pays_at(None, 5000) is None
    assert pays_from.pays_at("4000", 3999) is False and pays_from.pays_at("4000", 4000) is True
    assert pays_from.pays_at(">8000", 7000) is False and pays_from.pays_at(">8000", 9000) is None
    assert "pays from 12,288 tokens (measured by `prepare`" in pays_from.describe("12288")
    assert "not measured yet" in pays_from.describe(None) and "prepare" in pays_from.describe(None)
    assert "slower than dense at every length `prepare` measured, up to 9,000 tokens" in pays_from.describe(">9000")


def test_measured_crossover_is_saved_per_device_dtype_and_settings(tmp_path: Path):
    from adaptive_sparse_attention.bench.pays_from import ladder, measure

    choices = DenseChoices(tmp_path / "choices.json")
    config = SparseConfig(topk_ratio=0.25, kernel="torch", min_tokens=0, tail="none")
    sizes = ladder(frames=(2, 6), grid=(8, 8), heads=2, head_dim=32, text=16)
    lines: list[str] = []
    value, timings = measure(sizes, torch.device("cpu"), torch.float32, config, choices, echo=lines.append, reps=1)
    assert [t[0] for t in timings] == [s.total for s in sizes] == [16 + 22 + 128, 16 + 68 + 384]
    assert all(t[1] > 0 and t[2] > 0 for t in timings) and len(lines) == 2
    assert value == pays_from.crossover(timings)
    fresh = DenseChoices(tmp_path / "choices.json")  # another process reads it back
    assert pays_from.saved(fresh, torch.device("cpu"), torch.float32, config) == value
    assert pays_from.saved(fresh, torch.device("cpu"), torch.bfloat16, config) is None
    assert pays_from.saved(fresh, torch.device("cpu"), torch.float32, config.replace(topk_ratio=0.5)) is None


def test_a_run_note_is_said_once_per_run_and_shown_in_the_report(caplog):
    from adaptive_sparse_attention.nodes.report import format_report
    from adaptive_sparse_attention.nodes.run_tracker import RunTracker

    tracker = RunTracker("t")
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        for _ in range(3):
            tracker.say_in_report("529 tokens is too small")
            tracker.note_block(0, sparse=False, reason="529 tokens < min_tokens=12288")
    assert len(said(caplog, "t: 529 tokens is too small")) == 1
    tracker.finish()
    assert tracker.last_report["notes"] == ["529 tokens is too small"]
    assert "Note: 529 tokens is too small" in format_report(tracker.last_report)
    assert tracker.stats.notes == []  # the next run starts without it


def save_value(path: Path, value: str, **changes) -> None:
    """A crossover as `prepare` saves it, for the node's settings on this CPU (both dtypes the tiny model may run)."""
    from adaptive_sparse_attention.nodes.widgets import config_from_widgets

    choices = DenseChoices(path)
    config = config_from_widgets({**SPARSE, **changes})
    for dtype in (torch.float32, torch.bfloat16):
        choices.file.save(pays_from.pays_from_key(choices.describe_device(torch.device("cpu")), dtype, config), value)


def said(caplog, text: str, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("adaptive_sparse_attention") and r.levelno == level and text in r.getMessage()]


def report(model) -> str:
    from adaptive_sparse_attention.nodes.report_node import report_text

    return report_text(model)


@needs_comfyui
def test_below_min_tokens_is_said_once_with_the_unmeasured_crossover(comfy, caplog, tmp_path, monkeypatch):  # noqa: F811
    _, nodes = comfy
    monkeypatch.setenv("ADAPTIVE_SPARSE_DENSE_CACHE", str(tmp_path / "choices.json"))  # nothing measured
    model = sparse(nodes.UNETLoader().load_unet("tiny_h3_random.safetensors", "default")[0], min_tokens=100_000)
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        sample(nodes, model, steps=2)
        sample(nodes, model, steps=2)
    text = "529 tokens is below min_tokens=100,000, so attention runs dense at this size; from which size sparse " \
           "attention pays on this GPU is not measured yet"
    assert len(said(caplog, text)) == 1  # once at WARNING; the second run says it at INFO
    assert len(said(caplog, text, logging.INFO)) == 1
    assert f"Note: {text}" in report(model)


@needs_comfyui
def test_the_measured_crossover_is_named_below_min_tokens_and_below_itself(comfy, caplog, tmp_path,  # noqa: F811
                                                                          monkeypatch):
    _, nodes = comfy
    monkeypatch.setenv("ADAPTIVE_SPARSE_DENSE_CACHE", str(tmp_path / "choices.json"))
    loaded = nodes.UNETLoader().load_unet("tiny_h3_random.safetensors", "default")[0]
    save_value(tmp_path / "choices.json", "300")  # the key holds what the sparse time depends on, not min_tokens
    save_value(tmp_path / "choices.json", "2000", topk_ratio=0.5)
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        small = sparse(loaded, min_tokens=100_000)
        sample(nodes, small, steps=2)
        below = sparse(loaded, min_tokens=0, topk_ratio=0.5)
        sample(nodes, below, steps=2)
    first = said(caplog, "529 tokens is below min_tokens=100,000")
    assert len(first) == 1
    assert "on this GPU sparse attention pays from 300 tokens (measured by `prepare` at these settings); lower " \
           "min_tokens to 300 to run it sparse" in first[0]
    second = said(caplog, "529 tokens is too small for sparse attention to pay")
    assert len(second) == 1 and "pays from 2,000 tokens" in second[0] and "raise min_tokens to 2,000" in second[0]
    assert "529 tokens is too small for sparse attention to pay" in report(below)
    assert below.get_attachment("adaptive_sparse_attention.sparse").tracker.last_report["blocks_sparse"] > 0
