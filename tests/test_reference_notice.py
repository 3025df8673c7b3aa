"""Where no fast sparse kernel runs (the CPU, a GPU without Triton) the node's sparse blocks run dense on the
fastest dense kernel, said once per run and in the report; strict mode refuses; the pure-torch reference runs
when asked for by name (``kernel="torch"``)."""
from __future__ import annotations

import logging

import pytest
import torch

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.errors import SparseAttentionError
from adaptive_sparse_attention.kernels import registry
from adaptive_sparse_attention.kernels.vocabulary import Host
from adaptive_sparse_attention.nodes import reference_notice
from adaptive_sparse_attention.nodes.reference_notice import REASON, dense_notice, no_fast_kernel
from adaptive_sparse_attention.nodes.report import format_report
from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook
from h3_block import block_args
from h3_harness import PACKED, TOL, config, model_of, options, reference, run_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
CPU_WHY = ("no fast sparse kernel runs on this device (the model runs on the CPU); the fast kernels need an NVIDIA "
           "GPU (sm80 or newer) with Triton")


def test_on_the_cpu_it_names_the_cpu_and_what_is_needed():
    assert no_fast_kernel(SparseConfig(), CPU, torch.float32, 32) == CPU_WHY
    assert dense_notice(CPU_WHY) == (
        f"sparse blocks run dense attention on the fastest dense kernel: {CPU_WHY}. kernel='torch' runs them sparse "
        "on the pure-torch reference (correct, but slower than dense attention)")


def test_on_a_gpu_without_triton_it_says_what_to_install(monkeypatch):
    for module in (registry, reference_notice):  # the registry's resolution and the notice's candidate count
        monkeypatch.setattr(module, "current_host", lambda: Host(frozenset()))
    why = no_fast_kernel(SparseConfig(), CUDA, torch.bfloat16, 128)
    assert why.startswith(f"{REASON} (Triton is not installed); install triton")
    assert "`python install.py`" in why


def test_nothing_to_say_where_a_fast_kernel_runs_or_a_kernel_is_named(monkeypatch):
    assert no_fast_kernel(SparseConfig(kernel="torch"), CPU, torch.float32, 32) is None
    assert no_fast_kernel(SparseConfig(kernel="triton"), CPU, torch.float32, 32) is None  # the registry's fallback
    monkeypatch.setattr(reference_notice, "resolve_family", lambda *a, **k: "triton")  # a GPU with Triton
    assert no_fast_kernel(SparseConfig(), CUDA, torch.bfloat16, 128) is None


def test_without_a_fast_kernel_the_blocks_run_dense_said_once_and_in_the_report(caplog):
    model = model_of(True, seed=60)
    args = block_args(model.blocks[0], PACKED, seed=61, new=True)
    hook = SparseAttentionHook(config(kernel="auto"))  # the CPU: auto has no fast sparse kernel here
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        for step in (3, 4):
            args["transformer_options"] = options(step)
            out = run_model(model, hook, args, True)
    torch.testing.assert_close(out, reference(model, args, lambda block: block.attn), **TOL)
    notice = f"{hook.title}: {dense_notice(CPU_WHY)}"
    assert [r.getMessage() for r in caplog.records] == [notice]  # once per run, both blocks of both steps
    stats = hook.tracker.stats
    assert (stats.sparse_blocks, stats.dense_blocks, stats.dense_reasons) == (0, 4, {REASON: 4})
    hook.tracker.finish()
    text = format_report(hook.tracker.last_report)
    assert f"Note: {dense_notice(CPU_WHY)}" in text.splitlines()
    assert f"- {REASON}: 4 block calls" in text.splitlines()


def test_strict_refuses_to_run_the_sparse_blocks_dense():
    model = model_of(True, seed=62)
    args = block_args(model.blocks[0], PACKED, seed=63, new=True)
    args["transformer_options"] = options()
    with pytest.raises(SparseAttentionError, match=r"no fast sparse kernel runs on this device \(the model runs on "
                                                   r"the CPU\).*strict=True refuses"):
        run_model(model, SparseAttentionHook(config(kernel="auto", strict=True)), args, True)


def test_the_torch_reference_runs_when_named(caplog):
    model = model_of(True, seed=64)
    args = block_args(model.blocks[0], PACKED, seed=65, new=True)
    args["transformer_options"] = options()
    hook = SparseAttentionHook(config(kernel="torch"))
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        out = run_model(model, hook, args, True)
    assert hook.tracker.stats.sparse_blocks == 2 and hook.tracker.stats.dense_blocks == 0
    assert (out - reference(model, args, lambda block: block.attn)).abs().max() > 1e-6  # really sparse
    assert not any(REASON in r.getMessage() for r in caplog.records)


def test_auto_runs_sparse_where_sparse_choice_candidates_run(monkeypatch):
    """Two candidates of the measured sparse choice that run on the CPU (stand-ins): auto has a kernel to run."""
    from sparse_standins import StandIn, row

    from adaptive_sparse_attention.kernels.sparse_choice import choice as sparse_choice

    a, b = StandIn("a", 1.0), StandIn("b", 1.0)
    monkeypatch.setattr(sparse_choice, "SPARSE_KERNELS", (row(a), row(b)))
    assert no_fast_kernel(SparseConfig(), CPU, torch.float64, 32) is None
    model = model_of(True, seed=66)
    args = block_args(model.blocks[0], PACKED, seed=67, new=True)
    args["transformer_options"] = options()
    hook = SparseAttentionHook(config(kernel="auto"))
    run_model(model, hook, args, True)
    stats = hook.tracker.stats
    assert stats.sparse_blocks == 2 and sum(stats.sparse_kernels.values()) == 2
    assert set(stats.sparse_kernels) <= {"stand-in a", "stand-in b"}
