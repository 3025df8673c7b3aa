"""What users already run, composed with the node in real ComfyUI on the CPU (tiny random H3):

- a LoRA on the attention projections (qkv_proj, out_proj), loaded by ComfyUI's own
  LoraLoaderModelOnly from a LoRA file, before or after the node: where every block runs exact
  (topk_ratio 1.0 on the sparse path, or min_tokens above the sequence so every block runs dense on
  our dense kernel) the output is the dense model's with the same LoRA, so the node's own Q/K/V
  producer uses the LoRA-patched weights;
- the attention function ComfyUI selects (`--use-sage-attention` and its other attention flags):
  sparse blocks never call it, dense blocks call it with `dense_attention=comfyui` only; another
  node's `optimized_attention_override` (KJNodes' Sage patch sets one) runs the dense blocks;
- ComfyUI's EasyCache (comfy_extras/nodes_easycache.py) after and before the node: the steps
  EasyCache skips never reach the model, the steps it runs run sparse as the schedule says (the
  report node shows them), and at
  topk_ratio 1.0 the result is EasyCache on the dense model.

Tolerance 1e-4: the sparse path and ComfyUI's attention are two exact float32 kernels summing in
different orders over 4 denoising steps (the same bound as test_comfyui_real's weight patches).
"""
from __future__ import annotations

import logging

import pytest
import torch

from comfyui_harness import CKPT, LATENT, TINY, comfy, needs_comfyui, sample, sparse, summaries  # noqa: F401

pytestmark = needs_comfyui
LORA = "tiny_h3_attention_lora.safetensors"
SEQUENCE = 529  # tokens of the harness's LATENT with its 7 text rows: min_tokens above it runs every block dense
RANK = 4
CALLS = 2  # cfg > 1: a cond and an uncond pass per step, each through every block


@pytest.fixture(scope="module")
def lora_nodes(comfy):
    """ComfyUI's nodes with a rank-4 LoRA file (kohya key names) on every block's qkv_proj and
    out_proj in ComfyUI's `loras` folder."""
    base, nodes = comfy
    import folder_paths
    import safetensors.torch

    folder = base / "models" / "loras"
    folder.mkdir(parents=True, exist_ok=True)
    hidden, inner = TINY["hidden_size"], TINY["num_attention_heads"] * TINY["attention_head_dim"]
    g = torch.Generator().manual_seed(5)
    sd = {}
    for i in range(TINY["num_layers"]):
        for name, (out_dim, in_dim) in (("qkv_proj", (3 * inner, hidden)), ("out_proj", (hidden, inner))):
            key = f"lora_unet_blocks_{i}_attn_{name}"
            sd[f"{key}.lora_up.weight"] = 0.3 * torch.randn(out_dim, RANK, generator=g)
            sd[f"{key}.lora_down.weight"] = 0.3 * torch.randn(RANK, in_dim, generator=g)
            sd[f"{key}.alpha"] = torch.tensor(float(RANK))
    safetensors.torch.save_file(sd, str(folder / LORA))
    folder_paths.add_model_folder_path("loras", str(folder), is_default=True)
    return nodes


def with_lora(nodes, model):
    return nodes.LoraLoaderModelOnly().load_lora_model_only(model, LORA, 1.0)[0]


@pytest.mark.parametrize("exact", [dict(topk_ratio=1.0), dict(min_tokens=SEQUENCE + 1)], ids=["ratio-1", "all-dense"])
@pytest.mark.parametrize("order", ["lora-then-node", "node-then-lora"])
def test_lora_on_attention_projections_matches_the_dense_model_with_it(lora_nodes, caplog, exact, order):
    nodes = lora_nodes
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    dense_lora = sample(nodes, with_lora(nodes, model))
    assert (dense_lora - sample(nodes, model)).abs().max() > 1e-3  # the LoRA changes the output
    changes = dict(exact, warmup_mode="speed")
    patched = (sparse(with_lora(nodes, model), **changes) if order == "lora-then-node"
               else with_lora(nodes, sparse(model, **changes)))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        out = sample(nodes, patched)
    torch.testing.assert_close(out, dense_lora, rtol=1e-4, atol=1e-4)
    (_, _, dense_blocks, sparse_blocks), = summaries(caplog)
    if "topk_ratio" in exact:  # every block on the sparse path, Q/K/V from the node's own producer
        assert sparse_blocks == 4 * TINY["num_layers"] * CALLS
        assert dense_blocks == 0
    else:
        assert sparse_blocks == 0
        assert dense_blocks == 4 * TINY["num_layers"] * CALLS


def easycache(model):
    from comfy_extras.nodes_easycache import EasyCacheNode

    return EasyCacheNode.execute(model, 0.2, 0.15, 0.95, False).result[0]


def skipped(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("EasyCache - skipped")]


@pytest.mark.parametrize("order", ["node-then-easycache", "easycache-then-node"])
def test_easycache_composes_before_and_after_the_node(comfy, caplog, order):
    from adaptive_sparse_attention.nodes.model_patches import hooks_of
    from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook

    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]

    def compose(**changes):
        return easycache(sparse(model, **changes)) if order == "node-then-easycache" else sparse(easycache(model), **changes)

    with caplog.at_level(logging.INFO):
        cached_dense = sample(nodes, easycache(model), steps=8)
        assert skipped(caplog) == ["EasyCache - skipped 3/8 steps (1.60x speedup)."]  # it does skip here
        caplog.clear()
        exact = sample(nodes, compose(topk_ratio=1.0), steps=8)
        assert skipped(caplog) == ["EasyCache - skipped 3/8 steps (1.60x speedup)."]
        caplog.clear()
        patched = compose()
        out = sample(nodes, patched, steps=8)
    torch.testing.assert_close(exact, cached_dense, rtol=1e-4, atol=1e-4)
    assert skipped(caplog) == ["EasyCache - skipped 3/8 steps (1.60x speedup)."]
    assert torch.isfinite(out).all()  # the sparse steps did run sparse
    assert (out - cached_dense).abs().max() > 0
    # the 5 steps EasyCache runs reach the node: warmup 0.25 of 8 steps (steps 0-1) dense, 3 of steps 2-7 sparse
    (hook,) = [h for h in hooks_of(patched) if isinstance(h, SparseAttentionHook)]
    report = hook.tracker.last_report
    assert report["steps_dense"] == [0, 1]
    assert len(report["steps_sparse"]) == 3
    assert set(report["steps_sparse"]) <= set(range(2, 8))
    if order == "node-then-easycache":  # the node's wrapper sees every step, the last one too: summary at the end
        assert summaries(caplog) == [(2, 3, 2 * TINY["num_layers"] * CALLS, 3 * TINY["num_layers"] * CALLS)]
    else:  # EasyCache skipped the last step before it reached the node: the summary waits for the next run
        assert summaries(caplog) == []


@pytest.mark.parametrize("dense_attention", ["comfyui", "fastest"])
def test_comfyuis_selected_attention_runs_only_the_dense_blocks_it_is_given(comfy, caplog, monkeypatch,
                                                                          dense_attention):
    """`--use-sage-attention` (like ComfyUI's other attention flags) binds H3's `optimized_attention`
    to another function at import. A stand-in bound the same way (wrapped by ComfyUI's `wrap_attn`,
    as `attention_sage` is; it runs ComfyUI's PyTorch attention and counts its calls) shows what the
    node does with it: sparse blocks never call it; dense blocks (here the fidelity warmup step)
    call it with `dense_attention=comfyui`; with `fastest` it is one of the measured dense
    candidates (called while the choice is measured). Sage itself needs CUDA and is not run here.
    The stand-in keeps ComfyUI's `_inside_attn_wrapper` flag when it calls PyTorch's attention, as
    ComfyUI's own attention_sage does on its fallback (dropping it would re-enter the override)."""
    import comfy.ldm.minimax.model as h3
    from comfy.ldm.modules import attention

    calls = []

    @attention.wrap_attn
    def selected_attention(q, k, v, heads, **kwargs):
        calls.append(q.shape[-2] if kwargs.get("skip_reshape") else q.shape[1])
        return attention.attention_pytorch(q, k, v, heads, **kwargs)

    monkeypatch.setattr(h3, "optimized_attention", selected_attention)
    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        sample(nodes, sparse(model, dense_attention=dense_attention, tiling="cube"))
    (dense_steps, sparse_steps, dense_blocks, sparse_blocks), = summaries(caplog)
    assert (dense_steps, sparse_steps) == (1, 3)
    assert sparse_blocks > 0
    blocks = [rows for rows in calls if rows == SEQUENCE]  # the DiT blocks (the text refiner's calls are shorter)
    if dense_attention == "comfyui":  # every dense block, and no sparse one
        assert len(blocks) == dense_blocks
    else:  # measured as a candidate of the dense choice
        assert len(blocks) >= 1
    calls.clear()
    sample(nodes, model)  # without the node every block calls it
    assert calls.count(SEQUENCE) == 4 * TINY["num_layers"] * CALLS


def test_another_nodes_attention_override_keeps_the_dense_blocks(comfy, caplog):
    """KJNodes' "Patch Sage Attention KJ" sets `transformer_options["optimized_attention_override"]`
    on the model. A stand-in override set the same way (it runs ComfyUI's own attention and counts
    its DiT-block calls) before the node: it runs every dense block even with
    `dense_attention=fastest` (the node says so once), and no sparse block."""
    _, nodes = comfy
    calls = []

    def override(func, q, k, v, heads, **kwargs):
        calls.append(q.shape[-2] if kwargs.get("skip_reshape") else q.shape[1])
        return func(q, k, v, heads, **kwargs)

    model = nodes.UNETLoader().load_unet(CKPT, "default")[0].clone()
    model.model_options["transformer_options"]["optimized_attention_override"] = override
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        sample(nodes, sparse(model, dense_attention="fastest", tiling="cube"))
    (_, _, dense_blocks, sparse_blocks), = summaries(caplog)
    assert sparse_blocks > 0
    assert calls.count(SEQUENCE) == dense_blocks > 0
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "another node's optimized_attention_override runs the dense blocks" in logged
    assert "applies to dense blocks only; sparse blocks run adaptive sparse attention" in logged
