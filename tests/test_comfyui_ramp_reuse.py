"""The warmup ramp and plans reused across steps in real ComfyUI on the CPU (tiny random H3, 4 steps at cfg
3: two model calls a step, two blocks a call): the steps and densities, split sampling (KSamplerAdvanced
0-2 then 2-4), EasyCache skipping steps, and two of our nodes chained, each with both settings on."""
from __future__ import annotations

import logging

import pytest
import torch

from comfyui_harness import TINY, comfy, needs_comfyui, sample, sparse  # noqa: F401 (comfy is a fixture)
from test_comfyui_compose import easycache, skipped
from test_comfyui_states import load, sample_split

pytestmark = needs_comfyui
RAMP = dict(warmup_mode="ramp", warmup_ratio=0.5, plan_reuse="on")  # 4 steps: 0 dense, 1 ramped, 2-3 at topk_ratio
BLOCKS = 2 * TINY["num_layers"]  # block calls a step (cond and uncond)


def hook_of(model):
    from adaptive_sparse_attention.nodes.model_patches import hooks_of
    from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook

    (hook,) = [h for h in hooks_of(model) if isinstance(h, SparseAttentionHook)]
    return hook


def report_of(model) -> dict:
    return hook_of(model).tracker.last_report


def test_the_ramp_runs_the_first_step_dense_and_the_next_at_a_higher_density(comfy):
    _, nodes = comfy
    model = load(nodes)
    ramped = sparse(model, **RAMP)
    sample(nodes, ramped)
    report = report_of(ramped)
    assert (report["steps_dense"], report["steps_sparse"]) == ([0], [1, 2, 3])
    assert report["dense_reasons"] == {"warmup (ramp: dense at sigma 1, the start of the schedule)": BLOCKS}
    fidelity = sparse(model, warmup_mode="fidelity", warmup_ratio=0.25)  # the same sparse steps, all at topk_ratio
    sample(nodes, fidelity)
    assert report_of(fidelity)["steps_sparse"] == [1, 2, 3]
    assert report["mean_density"] > report_of(fidelity)["mean_density"]
    # step 1 builds every slot (2 branches x 2 blocks) at its ramped ratio, step 2 rebuilds them at topk_ratio,
    # step 3 reuses them
    assert report["plans"] == {"reused": BLOCKS, "built": 2 * BLOCKS, "rebuilds": BLOCKS, "built: first": BLOCKS,
                               "built: shape or settings changed": BLOCKS}
    assert not hook_of(ramped).tracker.plans.slots  # the run ended: its plans are dropped


def test_split_sampling_with_the_ramp_and_reuse_runs_the_whole_run(comfy):
    _, nodes = comfy
    model = load(nodes)
    unpatched_gap = (sample_split(nodes, model) - sample(nodes, model)).abs().max()
    patched = sparse(model, **RAMP)
    whole = sample(nodes, patched)
    expected = report_of(patched)
    gap = (sample_split(nodes, patched) - whole).abs().max()
    split = report_of(patched)
    for key in ("steps_dense", "steps_sparse", "blocks_dense", "blocks_sparse", "mean_density", "plans"):
        assert split[key] == expected[key], key  # same densities by sigma, plans kept across the two sampler calls
    assert gap <= 2 * unpatched_gap + 1e-5, (gap, unpatched_gap)


@pytest.mark.parametrize("order", ["node-then-easycache", "easycache-then-node"])
def test_easycache_skipped_steps_do_not_count_for_the_ramp_or_the_kept_plans(comfy, caplog, order):
    _, nodes = comfy
    model = load(nodes)

    settings = dict(RAMP, warmup_ratio=0.25)  # 8 steps: 0 dense, 1 ramped, 2-7 at topk_ratio (EasyCache skips some)

    def compose(**changes):
        return easycache(sparse(model, **changes)) if order == "node-then-easycache" else sparse(easycache(model), **changes)

    with caplog.at_level(logging.INFO):
        cached_dense = sample(nodes, easycache(model), steps=8)
        exact = sample(nodes, compose(**settings, topk_ratio=1.0), steps=8)
        torch.testing.assert_close(exact, cached_dense, rtol=1e-4, atol=1e-4)  # ramp and reuse at ratio 1: exact
        caplog.clear()
        patched = compose(**settings)
        out = sample(nodes, patched, steps=8)
    (message,) = skipped(caplog)
    ran = 8 - int(message.split("skipped ")[1].split("/")[0])
    assert torch.isfinite(out).all()
    report = report_of(patched)
    assert report["steps_dense"] == [0]
    assert len(report["steps_sparse"]) == ran - 1  # every step EasyCache ran reached the node, the others did not
    plans = report["plans"]
    assert plans["built"] + plans["reused"] == report["blocks_sparse"] == BLOCKS * (ran - 1)
    assert plans["reused"] > 0


def test_chained_nodes_the_one_nearer_the_sampler_ramps_and_reuses(comfy):
    _, nodes = comfy
    model = load(nodes)
    alone = sparse(model, **RAMP)
    reference = sample(nodes, alone)
    chained = sparse(sparse(model, warmup_mode="dense"), **RAMP)
    torch.testing.assert_close(sample(nodes, chained), reference, rtol=1e-4, atol=1e-4)  # dense kernels: measured choice
    assert report_of(chained)["plans"] == report_of(alone)["plans"]
    last_dense = sparse(sparse(model, **RAMP), warmup_mode="dense")
    sample(nodes, last_dense)
    assert report_of(last_dense)["blocks_sparse"] == 0 and report_of(last_dense)["plans"]["built"] == 0
