"""tail="coarse" on a real ComfyUI H3 with and without the learned gate (COMFYUI_PATH, CPU).

Needs a ComfyUI whose H3 has current upstream's `gate_compress` (to_gate_compress layers, which
distilled FastH3 checkpoints carry); the pinned fork's H3 has none, so the test skips there.
"""
from __future__ import annotations

import inspect
import logging

import pytest
import torch

from comfyui_harness import CKPT, comfy, needs_comfyui, sample, save_tiny_h3, sparse  # noqa: F401 (comfy is a fixture)

pytestmark = needs_comfyui
GATED = "tiny_h3_gated.safetensors"


def test_the_gate_makes_the_coarse_branch_real(comfy, caplog):  # noqa: F811
    base, nodes = comfy
    from comfy.ldm.minimax.model import MiniMaxH3Model

    if "gate_compress" not in inspect.signature(MiniMaxH3Model).parameters:
        pytest.skip("this ComfyUI's MiniMax-H3 has no to_gate_compress layers (current upstream has)")
    save_tiny_h3(base / "models" / "diffusion_models" / GATED, gate_compress=True)
    gated = nodes.UNETLoader().load_unet(GATED, "default")[0]
    assert all(b.attn.to_gate_compress is not None for b in gated.get_model_object("diffusion_model").blocks)
    coarse = dict(tail="coarse", tail_granularity="block")
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        with_gate = sample(nodes, sparse(gated, **coarse), steps=2)
        assert not any("to_gate_compress" in r.getMessage() for r in caplog.records)
        without = sample(nodes, sparse(gated, tail="none", tail_granularity="block"), steps=2)
        assert (with_gate - without).abs().max() > 1e-5  # the coarse branch now changes the result

        plain = nodes.UNETLoader().load_unet(CKPT, "default")[0]  # the base model: no gate
        torch.testing.assert_close(sample(nodes, sparse(plain, **coarse), steps=2),
                                   sample(nodes, sparse(plain, tail="none", tail_granularity="block"), steps=2),
                                   rtol=0, atol=0)
    assert any("no to_gate_compress gate" in r.getMessage() for r in caplog.records)
