"""Every patched model runs with its own state, in the ways ComfyUI runs one model (real ComfyUI, CPU).

MultiGPU CFG Split (its deepclone on a second device, two device threads; the second device is
the CPU again under another name), two threads sampling one patched model, split sampling
(KSamplerAdvanced 0-2 then 2-4), two of our nodes chained in both orders, and an interrupted
run followed by a full one. The tiny random H3 of `comfyui_harness` samples 4 steps at cfg 3:
two model calls per step, two blocks per call.
"""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from comfyui_harness import CKPT, comfy, needs_comfyui, sample, sparse  # noqa: F401 (comfy is a fixture)

pytestmark = needs_comfyui
WHOLE_RUN = {"steps_dense": [0], "steps_sparse": [1, 2, 3], "blocks_dense": 4, "blocks_sparse": 12}


def report_of(model) -> dict:
    """The counts of the last run in the sparse hook of `model` (steps and blocks)."""
    from adaptive_sparse_attention.nodes.model_patches import hooks_of

    (hook,) = hooks_of(model)
    return {k: hook.tracker.last_report[k] for k in WHOLE_RUN}


def load(nodes):
    return nodes.UNETLoader().load_unet(CKPT, "default")[0]


def test_a_deepclone_computes_with_its_own_weights(comfy):
    _, nodes = comfy
    patched = sparse(load(nodes))
    clone = patched.deepclone_multigpu(new_load_device=torch.device("cpu"))
    before = sample(nodes, clone)
    original = patched.get_model_object("diffusion_model")
    with torch.no_grad():
        original.blocks[0].attn.qkv_proj.weight.zero_()
    assert (sample(nodes, patched) - before).abs().max() > 1e-4  # the change matters to the original
    torch.testing.assert_close(sample(nodes, clone), before, rtol=0, atol=0)  # and not to the clone
    assert report_of(clone) == WHOLE_RUN


@pytest.fixture
def two_devices(monkeypatch):
    """ComfyUI sees a second device: the CPU under another name (ComfyUI keys its clones by device)."""
    import comfy.model_management as mm

    monkeypatch.setattr(mm, "get_all_torch_devices",
                        lambda exclude_current=False: [torch.device("cpu"), torch.device("cpu", 0)])


def test_multigpu_cfg_split_runs_each_device_with_its_own_state(comfy, two_devices, caplog):  # noqa: F811
    _, nodes = comfy
    from comfy_extras.nodes_multigpu import MultiGPUCFGSplitNode

    lone = sample(nodes, sparse(load(nodes)))
    split = MultiGPUCFGSplitNode.execute(sparse(load(nodes)), 2).result[0]
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        for _ in range(3):  # the device threads once raced on one tracker (KeyError, mixed reports)
            torch.testing.assert_close(sample(nodes, split), lone, rtol=1e-5, atol=1e-5)
            # cond and uncond ran on the two devices: each device's state counted its own half
            (clone,) = split.get_additional_models_with_key("multigpu")  # the sampler re-clones it
            half = {**WHOLE_RUN, "blocks_dense": 2, "blocks_sparse": 6}
            assert report_of(clone) == half
            assert report_of(split) == half
    # nothing but the CPU's reference-kernel warning (the CPU runs the torch kernel; once per run and device)
    assert not [r for r in caplog.records if "pure-torch reference kernel" not in r.getMessage()]


def copied(value):
    """`value` with its tensors (in lists, tuples and dicts) copied: the sampler reuses its buffers."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(copied(v) for v in value)
    if isinstance(value, dict) and not isinstance(value, type):
        return {k: copied(v) for k, v in value.items()}
    return value


def test_two_threads_on_one_patched_model_match_a_lone_run(comfy):
    """The model calls of one sampled model replayed from two threads at once (ComfyUI's own
    per-model sampling state forbids two samplers on one ModelPatcher; its device threads call
    the model concurrently)."""
    _, nodes = comfy
    import comfy.patcher_extension as pe

    patched = sparse(load(nodes)).clone()
    recorded = []

    def record(executor, x, timestep, context, transformer_options, *args, **kwargs):
        kept = copied((x, timestep, context, dict(transformer_options), args, kwargs))
        out = executor(x, timestep, context, transformer_options, *args, **kwargs)
        recorded.append((executor.class_obj, *kept, copied(out)))
        return out

    patched.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test-record", record)
    sample(nodes, patched)
    assert len(recorded) == 8

    def replay(call) -> torch.Tensor:
        model, x, timestep, context, options, args, kwargs, _ = call
        wrappers = {k: dict(v) for k, v in options["wrappers"].items()}
        wrappers[pe.WrappersMP.DIFFUSION_MODEL].pop("test-record")
        executor = pe.WrapperExecutor.new_class_executor(
            model._forward, model, pe.get_all_wrappers(pe.WrappersMP.DIFFUSION_MODEL, {"wrappers": wrappers}))
        with torch.no_grad():
            return executor.execute(x, timestep, context, {**options, "wrappers": wrappers}, *args, **kwargs)

    for _ in range(3):
        outs, errors = {}, []

        def run(thread: int) -> None:
            try:
                for i, call in enumerate(recorded):
                    outs[thread, i] = replay(call)
            except Exception as err:  # noqa: BLE001 (asserted below)
                errors.append(err)

        threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for (_, i), out in outs.items():
            torch.testing.assert_close(out, recorded[i][-1], rtol=0, atol=0)
        assert len(outs) == 2 * len(recorded)


def sample_split(nodes, model, cfg: float = 3.0):
    """KSamplerAdvanced steps 0-2 (leftover noise kept) then 2-4 of the same 4-step schedule."""
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    from comfyui_harness import LATENT

    latent = EmptyMiniMaxH3LatentAV.execute(**LATENT).result[0]
    g = torch.Generator().manual_seed(1)
    pos, neg = [[torch.randn(1, 7, 48, generator=g), {}]], [[torch.randn(1, 7, 48, generator=g), {}]]
    ksampler = nodes.KSamplerAdvanced()
    first = ksampler.sample(model, "enable", 7, 4, cfg, "euler", "simple", pos, neg, latent, 0, 2, "enable")[0]
    out = ksampler.sample(model, "disable", 7, 4, cfg, "euler", "simple", pos, neg, first, 2, 4, "disable")[0]
    return torch.cat([t.flatten() for t in out["samples"].unbind()])


def test_split_sampling_runs_the_dense_steps_of_the_whole_schedule(comfy):
    _, nodes = comfy
    model = load(nodes)
    unpatched_gap = (sample_split(nodes, model) - sample(nodes, model)).abs().max()
    patched = sparse(model)
    whole = sample(nodes, patched)
    assert report_of(patched) == WHOLE_RUN
    gap = (sample_split(nodes, patched) - whole).abs().max()
    assert report_of(patched) == WHOLE_RUN  # one run over both sampler calls, steps numbered 0-3
    assert gap <= 2 * unpatched_gap + 1e-5, (gap, unpatched_gap)


def test_the_node_nearer_the_sampler_decides_in_either_order(comfy, caplog):
    _, nodes = comfy
    from adaptive_sparse_attention.nodes.report_node import report_text

    model = load(nodes)
    dense = sample(nodes, model)
    first = sparse(model, topk_ratio=0.25)
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        last_dense = sparse(first, warmup_mode="dense")
        torch.testing.assert_close(sample(nodes, last_dense), dense, rtol=1e-4, atol=1e-4)
    assert report_of(last_dense) == {"steps_dense": [0, 1, 2, 3], "steps_sparse": [], "blocks_dense": 16,
                                     "blocks_sparse": 0}
    assert not any("another node's optimized_attention_override" in r.getMessage() for r in caplog.records)
    assert any("the one nearer the sampler decides" in r.getMessage() for r in caplog.records)
    assert "warmup_mode='dense': 16 block calls" in report_text(first)  # upstream, the report shows what ran

    last_exact = sparse(sparse(model, warmup_mode="dense"), topk_ratio=1.0)
    torch.testing.assert_close(sample(nodes, last_exact), dense, rtol=1e-4, atol=1e-4)
    assert report_of(last_exact) == WHOLE_RUN
    assert "the one nearer the sampler decides" in report_text(last_exact)


def test_an_interrupted_run_then_a_full_run_reports_the_full_run(comfy):
    _, nodes = comfy
    import comfy.patcher_extension as pe

    patched = sparse(load(nodes)).clone()
    calls = {"n": 0, "stop_at": 5}  # the 5th model call: step 2's first

    def interrupt(executor, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["stop_at"]:
            raise KeyboardInterrupt("interrupted by the test")
        return executor(*args, **kwargs)

    patched.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test-interrupt", interrupt)
    with pytest.raises(KeyboardInterrupt):
        sample(nodes, patched)
    assert report_of(patched) == {"steps_dense": [0], "steps_sparse": [1], "blocks_dense": 4, "blocks_sparse": 4}
    calls["stop_at"] = None
    sample(nodes, patched)
    assert report_of(patched) == WHOLE_RUN
