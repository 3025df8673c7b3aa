"""A FastH3 checkpoint (to_gate_compress layers) and ComfyUI's core sparse node beside ours (real ComfyUI, CPU).

A distilled FastH3 checkpoint was trained for VSA's pattern, which this node does not run: the node
says so once at WARNING and in the report, names ComfyUI's core "Model Sparse Attention" node with
vsa, leaves the attention to ComfyUI (strict refuses), and the FastH3 template's core node keeps
working beside it in either order. The pinned fork's H3 has no to_gate_compress layers (current
upstream builds them from the checkpoint's keys, `gate_compress=True`); there the test loads the
checkpoint through UNETLoader (which drops the gate keys) and gives each block the gate layer the
file carries, as current upstream's loader would.
"""
from __future__ import annotations

import inspect
import logging

import pytest
import safetensors.torch
import torch

from comfyui_harness import (TINY, comfy, core_sparse_node, needs_comfyui, sample,  # noqa: F401 (fixture)
                             save_tiny_h3, sparse)

pytestmark = needs_comfyui
GATED = "tiny_h3_fasth3.safetensors"
VSA = "ComfyUI's core 'Model Sparse Attention' node (BlockSparseAttention) with method vsa"


@pytest.fixture(scope="module")
def fasth3(comfy):  # noqa: F811
    """load() -> a FastH3 ModelPatcher whose blocks carry the checkpoint's to_gate_compress layers."""
    base, nodes = comfy
    from comfy.ldm.minimax.model import MiniMaxH3Model

    native = "gate_compress" in inspect.signature(MiniMaxH3Model).parameters
    path = base / "models" / "diffusion_models" / GATED
    if native:
        save_tiny_h3(path, gate_compress=True)
    else:  # the checkpoint as published: the base model's keys plus blocks.N.attn.to_gate_compress.weight
        save_tiny_h3(path)
        sd = safetensors.torch.load_file(str(path))
        g = torch.Generator().manual_seed(5)
        inner = TINY["num_attention_heads"] * TINY["attention_head_dim"]
        for i in range(TINY["num_layers"]):
            sd[f"blocks.{i}.attn.to_gate_compress.weight"] = torch.randn(inner, TINY["hidden_size"], generator=g) * 0.3
        safetensors.torch.save_file(sd, str(path))

    def load():
        model = nodes.UNETLoader().load_unet(GATED, "default")[0]
        if not native:
            import comfy.ops

            sd = safetensors.torch.load_file(str(path))
            for i, block in enumerate(model.get_model_object("diffusion_model").blocks):
                w = sd[f"blocks.{i}.attn.to_gate_compress.weight"]
                block.attn.to_gate_compress = comfy.ops.disable_weight_init.Linear(w.shape[1], w.shape[0], bias=False)
                block.attn.to_gate_compress.weight = torch.nn.Parameter(w.to(block.attn.qkv_proj.weight.dtype),
                                                                        requires_grad=False)
        assert all(b.attn.to_gate_compress is not None for b in model.get_model_object("diffusion_model").blocks)
        return model
    return load


@pytest.fixture(scope="module", params=["replaces", "chains"])
def core_node(comfy, request):  # noqa: F811
    """apply(model) of the core node's patching: the real node with vsa when ComfyUI has it, else a stand-in."""
    with core_sparse_node(request.param, {"selection": "vsa", "keep_percent": 10}) as apply:
        if apply is None:
            pytest.skip("this ComfyUI has the real core node (tested in the other parametrization)")
        yield apply


def warnings_with(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("adaptive_sparse_attention") and r.levelno >= logging.WARNING and text in r.getMessage()]


def report(model) -> str:
    from adaptive_sparse_attention.nodes.report_node import report_text

    return report_text(model)


def test_fasth3_checkpoint_is_left_to_comfyui_with_one_warning_naming_the_core_node(comfy, fasth3, caplog):  # noqa: F811
    _, nodes = comfy
    model = fasth3()
    plain = sample(nodes, model, steps=2)
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        ours = sparse(model, strict=False)
        out = sample(nodes, ours, steps=2)
        sample(nodes, ours, steps=2)  # a second run says it at INFO only
    said = warnings_with(caplog, "to_gate_compress")
    assert len(said) == 1 and VSA in said[0] and "trained for VSA's sparse pattern" in said[0]
    torch.testing.assert_close(out, plain, rtol=0, atol=0)  # ComfyUI's own attention, untouched
    text = report(ours)
    assert "The sparse path did not run" in text
    assert "FastH3 checkpoint (to_gate_compress, trained for VSA's pattern): left to ComfyUI's attention" in text
    assert VSA in text  # the note


def test_strict_refuses_a_fasth3_checkpoint(comfy, fasth3):  # noqa: F811
    with pytest.raises(ValueError, match=r"distilled FastH3 checkpoint.*with method vsa.*strict=True refuses"):
        sparse(fasth3())  # the harness's settings are strict


def test_tail_coarse_runs_ours_with_the_gate_and_says_what_it_is(comfy, fasth3, caplog):  # noqa: F811
    _, nodes = comfy
    model = fasth3()
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        ours = sparse(model, tail="coarse", tail_granularity="block")
        sample(nodes, ours, steps=2)
    said = warnings_with(caplog, "tail='coarse' on a distilled FastH3 checkpoint")
    assert len(said) == 1 and "method vsa" in said[0]
    assert ours.get_attachment("adaptive_sparse_attention.sparse").tracker.last_report["blocks_sparse"] > 0


@pytest.mark.parametrize("order", ["before", "after"])
def test_the_templates_core_node_keeps_working_beside_ours(comfy, fasth3, core_node, caplog, order):  # noqa: F811
    _, nodes = comfy
    model = fasth3()
    alone = sample(nodes, core_node(model), steps=2)
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        both = core_node(sparse(model, strict=False)) if order == "after" else sparse(core_node(model), strict=False)
        out = sample(nodes, both, steps=2)
    said = warnings_with(caplog, "'Model Sparse Attention' node (BlockSparseAttention) is applied")
    assert len(said) == 1 and f"applied {order} this node" in said[0] and "leaves the attention to it" in said[0]
    torch.testing.assert_close(out, alone, rtol=0, atol=0)  # what the core node runs, as without ours
    text = report(both)
    assert f"Note: adaptive sparse attention: ComfyUI's 'Model Sparse Attention' node (BlockSparseAttention) is " \
           f"applied {order} this node" in text
    if getattr(core_node, "keywords", {}).get("form") != "replaces":  # the core node calls ours on the rest
        assert "left to ComfyUI's 'Model Sparse Attention' node, which runs these blocks" in text


def test_strict_still_refuses_the_core_node_beside_ours(comfy, fasth3, core_node):  # noqa: F811
    _, nodes = comfy
    coarse = dict(tail="coarse", tail_granularity="block")  # past the FastH3 refusal (the previous test)
    with pytest.raises(ValueError, match=r"applied before this node.*Keep one of the two nodes"):
        sparse(core_node(fasth3()), **coarse)
    with pytest.raises(ValueError, match=r"applied after this node.*Keep one of the two nodes"):
        sample(nodes, core_node(sparse(fasth3(), **coarse)), steps=2)
