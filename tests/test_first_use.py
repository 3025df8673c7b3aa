"""The first sparse use of a layout says that the kernels are being prepared before the wait starts:
in the console and as progress text on the node ComfyUI is running (real ComfyUI, CPU; the Triton
backend under its interpreter stands in for a GPU's compiled kernels)."""
from __future__ import annotations

import importlib.util
import logging
import time

import pytest

from comfyui_harness import CKPT, comfy, needs_comfyui, sample  # noqa: F401 (comfy is a fixture)

pytestmark = [needs_comfyui,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (interpreter)")]


def test_kernel_preparation_is_announced_on_the_running_node_before_it_runs(comfy, interpreter, monkeypatch,
                                                                             caplog):
    _, nodes = comfy
    import server
    from comfy_execution.utils import CurrentNodeContext

    from adaptive_sparse_attention import SparseConfig
    from adaptive_sparse_attention.backend import warmup
    from adaptive_sparse_attention.nodes.sparse_policy import apply_sparse_attention

    events = []

    class UI:  # ComfyUI's PromptServer as far as progress text goes
        def send_progress_text(self, text, node_id, sid=None):
            events.append(("text", node_id, text))

    monkeypatch.setattr(server.PromptServer, "instance", UI(), raising=False)
    compile_call = warmup.sparse_attention
    monkeypatch.setattr(warmup, "sparse_attention",
                        lambda q, *a, **kw: events.append(("prepare", q.shape[1], q.stride(1))) or compile_call(q, *a, **kw))
    config = SparseConfig(kernel="triton", tiling="cube", topk_ratio=0.25, warmup_ratio=0.5, min_tokens=0, strict=True)
    model = apply_sparse_attention(nodes.UNETLoader().load_unet(CKPT, "default")[0], config)
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"), CurrentNodeContext("prompt", "7"):
        sample(nodes, model, steps=2)
    texts = [e for e in events if e[0] == "text"]
    assert len(texts) == 1, events  # once per layout, not per block or step
    _, node, text = texts[0]
    assert node == "7"
    assert "preparing the sparse-attention kernels" in text
    assert "prepare" in text
    heads = model.model.diffusion_model.blocks[0].attn.heads
    assert heads > 1
    # the real head count (a launch may pick its chunk by its programs), one head's memory: expanded, stride 0
    assert events.index(texts[0]) < events.index(("prepare", heads, 0))  # said before the wait
    logged = [r.getMessage() for r in caplog.records]
    assert text in logged
    assert any("kernels ready in" in m for m in logged)
    assert logged.index(text) < next(i for i, m in enumerate(logged) if "kernels ready in" in m)


def test_patching_a_model_for_a_cuda_gpu_starts_the_standby_child(comfy):
    """The node's patch starts the owner's standby child (`install.py prepare --shape -`) where the model loads
    onto a CUDA device, so its start-up runs while ComfyUI loads the model and the prompt; on the CPU none.
    The patcher's load device is set to CUDA here; nothing runs on it (the child only imports and waits)."""
    _, nodes = comfy
    import torch

    from adaptive_sparse_attention import SparseConfig
    from adaptive_sparse_attention.nodes.model_patches import hooks_of
    from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook, apply_sparse_attention
    from adaptive_sparse_attention.nodes.warm_start import STANDBY_KEY, STANDBY_LINE

    def warm_start_of(model):
        (hook,) = [h for h in hooks_of(model) if isinstance(h, SparseAttentionHook)]
        return hook.warm_start

    base = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    assert not warm_start_of(apply_sparse_attention(base, SparseConfig(kernel="triton"))).jobs  # CPU: no child
    base.load_device = torch.device("cuda")
    warm = warm_start_of(apply_sparse_attention(base, SparseConfig(kernel="triton")))
    spare = warm.jobs[STANDBY_KEY]
    try:
        deadline = time.perf_counter() + 120
        while STANDBY_LINE not in spare.text() and time.perf_counter() < deadline:
            assert spare.poll() is None, spare.text()
            time.sleep(0.1)
        assert STANDBY_LINE in spare.text() and spare.poll() is None  # up, waiting for the run shape
    finally:
        warm.close()
    assert spare.process.returncode is not None
