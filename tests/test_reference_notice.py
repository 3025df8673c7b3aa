"""A run whose sparse blocks run the pure-torch reference kernel says so: the reason and what to install,
once per run at WARNING level and in the run's report; a negative saving reads as time lost."""
from __future__ import annotations

import logging

import torch

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.kernels import registry
from adaptive_sparse_attention.kernels.vocabulary import Host
from adaptive_sparse_attention.nodes.reference_notice import reference_kernel_notice
from adaptive_sparse_attention.nodes.report import format_report
from adaptive_sparse_attention.nodes.run_tracker import RunTracker

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_on_the_cpu_it_names_the_cpu_and_what_is_needed():
    notice = reference_kernel_notice("torch", SparseConfig(), CPU, torch.float32, 32)
    assert notice == ("sparse blocks run the pure-torch reference kernel, which is correct but slower than dense "
                      "attention: the model runs on the CPU; the fast kernels need an NVIDIA GPU (sm80 or newer) with "
                      "Triton; bypass this node on the CPU except for tests")


def test_on_a_gpu_without_triton_it_says_what_to_install(monkeypatch):
    monkeypatch.setattr(registry, "current_host", lambda: Host(frozenset()))
    notice = reference_kernel_notice("torch", SparseConfig(), CUDA, torch.bfloat16, 128)
    assert ": Triton is not installed; install triton" in notice
    assert "`python install.py`" in notice


def test_nothing_to_say_when_a_fast_kernel_runs_or_torch_was_asked_for():
    assert reference_kernel_notice("triton", SparseConfig(), CUDA, torch.bfloat16, 128) is None
    assert reference_kernel_notice("cudnn", SparseConfig(), CUDA, torch.bfloat16, 128) is None
    assert reference_kernel_notice("torch", SparseConfig(kernel="torch"), CPU, torch.float32, 32) is None


def test_the_report_puts_the_notice_first_and_says_time_lost(caplog):
    tracker = RunTracker("adaptive sparse attention")
    notice = reference_kernel_notice("torch", SparseConfig(), CPU, torch.float32, 32)
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        for _ in range(3):  # every sparse call of the run reaches it; said and kept once
            tracker.say_in_report(notice)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, f"adaptive sparse attention: {notice}")]
    tracker.note_block(1, sparse=True, density=0.5, layer=0)
    tracker.stats.attention_ms = 3000.0
    tracker.note_timing(("shape",), sparse_ms=300.0, dense_ms=100.0)
    tracker.finish()
    lines = format_report(tracker.last_report).splitlines()
    assert lines[-1] == f"Note: {notice}"
    assert lines[3] == ("Sparse attention time: 3.00 s; estimated time lost: 2.00 s (sparse attention was SLOWER than "
                        "torch's dense attention, timed on one call per shape)")
    assert tracker.stats.notes == []  # the next run says it again
