"""The first sparse use of a layout prepares its kernels in this process, shown in the console and as progress
text on the node ComfyUI is running, and the run starts no process (real ComfyUI, CPU; the Triton backend under
its interpreter stands in for a GPU's compiled kernels)."""
from __future__ import annotations

import importlib.util
import logging
import subprocess

import pytest

from comfyui_harness import CKPT, comfy, needs_comfyui, sample  # noqa: F401 (comfy is a fixture)

pytestmark = [needs_comfyui,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (interpreter)")]


def test_kernel_preparation_is_announced_on_the_running_node_and_starts_no_process(comfy, interpreter, monkeypatch,
                                                                                   caplog):
    _, nodes = comfy
    import server
    from comfy_execution.utils import CurrentNodeContext

    from adaptive_sparse_attention import SparseConfig
    from adaptive_sparse_attention.backend import prepare
    from adaptive_sparse_attention.nodes.sparse_policy import apply_sparse_attention

    events = []

    class UI:  # ComfyUI's PromptServer as far as progress text goes
        def send_progress_text(self, text, node_id, sid=None):
            events.append(("text", node_id, text))

    monkeypatch.setattr(server.PromptServer, "instance", UI(), raising=False)

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started during the run: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    compile_call = prepare.sparse_attention
    monkeypatch.setattr(prepare, "sparse_attention",
                        lambda q, *a, **kw: events.append(("prepare", q.shape[1], q.stride(1))) or compile_call(q, *a, **kw))
    config = SparseConfig(kernel="triton", tiling="cube", topk_ratio=0.25, warmup_ratio=0.5, min_tokens=0, strict=True)
    model = apply_sparse_attention(nodes.UNETLoader().load_unet(CKPT, "default")[0], config)
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"), CurrentNodeContext("prompt", "7"):
        sample(nodes, model, steps=2)
    texts = [e for e in events if e[0] == "text"]
    assert len(texts) == 2, events  # once per layout, not per block or step: its start and its end
    (_, node, start), (_, _, end) = texts
    assert node == "7"
    assert "preparing the sparse-attention kernels" in start and "kernels ready in" in end
    assert "0 compiled" in end  # the interpreter compiles nothing
    heads = model.model.diffusion_model.blocks[0].attn.heads
    assert heads > 1
    # the real head count (a launch may pick its chunk by its programs), one head's memory: expanded, stride 0
    assert events.index(texts[0]) < events.index(("prepare", heads, 0)) < events.index(texts[1])
    logged = [r.getMessage() for r in caplog.records]
    assert end in logged
