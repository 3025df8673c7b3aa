"""GGUF checkpoints loaded by ComfyUI-GGUF's UnetLoaderGGUF, in real ComfyUI (COMFYUI_PATH, CPU).

Needs a ComfyUI-GGUF checkout (city96/ComfyUI-GGUF, pinned at commit
795e45156ece99afbc3efef911e63fcb46e6a20d, 2025-12-18) in COMFYUI_GGUF_PATH, outside this
repository, and the `gguf` package (PyPI, pure Python) in the environment; skipped without them.
The pack is loaded as ComfyUI loads a custom node (`nodes.load_custom_node`).

Files: the harness's tiny random H3 in Q8_0, and a 256-wide variant (`TINY_K`: hidden 256, two
heads of 128, FFN 512) in Q4_K, whose blocks of 256 values need rows of 256; tensors are typed as
ComfyUI-GGUF's convert tool would (gguf_files.py). `general.architecture` is "wan": the loader at
the pinned commit lists no MiniMax-H3 architecture, ComfyUI detects H3 from the keys, and published
H3 GGUF files carry a listed name.

What is checked: the GGUF layers' Q/K/V through our producer equal the layer's own (captured at
the attention call of `Attention.forward` on the same chunks of rows), bit for bit, with and
without head groups, and ComfyUI's plain cast of such a weight is refused with the layer's class
named (the old path multiplied the quantised bytes); whole KSampler runs with our node at
topk_ratio 1.0 (every block through our producer and kernel) against the same GGUF model without
our node (relative error < 1e-5: the exact kernel sums in another order than SDPA; the quantisation
itself moves the output > 100x more), with a LoRA (LoraLoaderModelOnly) and with head groups
(KJNodes' ``minimax_head_chunks``; KJNodes' own node too when KJNODES_PATH is set); the node's
defaults with min_tokens 0 (so that the tiny sequence runs sparse) within 1e-3 of it; and a
KSampler run with the node's defaults on the Q4_K file.
"""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import os

import pytest
import torch

from comfyui_harness import (CKPT, TINY, comfy, layer_qkv, needs_comfyui, sample, save_tiny_h3, sparse,  # noqa: F401
                             summaries)
from gguf_files import write_gguf

from adaptive_sparse_attention.backend import producer
from adaptive_sparse_attention.nodes.widgets import SPARSE_WIDGETS

GGUF_PACK = os.environ.get("COMFYUI_GGUF_PATH", "")
KJNODES = os.environ.get("KJNODES_PATH", "")
TINY_K = dict(TINY, hidden_size=256, attention_head_dim=128, ffn_hidden_size=512, rope_inv_freq_len=16)
FILES = {"Q8_0": ("tiny_h3_q8_0.gguf", TINY), "Q4_K": ("tiny_h3_256_q4_k.gguf", TINY_K)}
DEFAULTS = {w.name: w.default for w in SPARSE_WIDGETS}  # the node as a user drops it in
EXACT = dict(topk_ratio=1.0, warmup_ratio=0.0)  # every block through our producer and kernel, all pairs exact
STEPS = 2  # sampling steps of the comparisons (the node-defaults run keeps the harness's 4)

pytestmark = [needs_comfyui,
              pytest.mark.skipif(not os.path.isfile(os.path.join(GGUF_PACK, "nodes.py")),
                                 reason="set COMFYUI_GGUF_PATH to a city96/ComfyUI-GGUF checkout (pinned commit "
                                        "795e4515) to run the GGUF tests")]


@pytest.fixture(scope="module")
def gguf_pack(comfy):
    """ComfyUI-GGUF loaded as ComfyUI loads a custom node; its nodes module."""
    pytest.importorskip("gguf", reason="the gguf package (pip install gguf) writes and reads the test files")
    _, nodes = comfy
    assert asyncio.run(nodes.load_custom_node(GGUF_PACK))
    return importlib.import_module(f"{GGUF_PACK.replace('.', '_x_')}.nodes")


@pytest.fixture(scope="module")
def gguf_files(comfy, gguf_pack):
    """{qtype: (file name, dims, {key: GGML type written})} in ComfyUI's diffusion_models folder."""
    import safetensors.torch

    base, _ = comfy
    folder = base / "models" / "diffusion_models"
    save_tiny_h3(folder / "tiny_h3_256.safetensors", dims=TINY_K)
    written = {}
    for qtype, (name, dims) in FILES.items():
        source = folder / (CKPT if dims is TINY else "tiny_h3_256.safetensors")
        types = write_gguf(safetensors.torch.load_file(str(source)), folder / name, qtype)
        written[qtype] = (name, dims, types, source.name)
    return written


def load(gguf_pack, name: str):
    return gguf_pack.UnetLoaderGGUF().load_unet(name)[0]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def block_inputs(seq: int, hidden: int, rot_pairs: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(seq, hidden, generator=g).to(dtype)
    angle = torch.rand(1, seq, 1, rot_pairs, generator=g) * 6.0
    rope = torch.stack([torch.stack([angle.cos(), -angle.sin()], -1), torch.stack([angle.sin(), angle.cos()], -1)], -2)
    return x, rope


@pytest.mark.parametrize("qtype", FILES)
def test_files_load_as_gguf_layers_of_their_type(comfy, gguf_pack, gguf_files, qtype):
    """The loader reads our files into GGMLOps layers; ComfyUI-GGUF's dequantiser of the qkv weight
    agrees with the gguf package's (so the Q4_K blocks written here are read as gguf defines them)."""
    import gguf
    import numpy as np

    name, dims, types, _ = gguf_files[qtype]
    assert types["blocks.0.attn.qkv_proj.weight"] == qtype
    assert types["blocks.0.attn.q_norm.weight"] == "F32" and types["rope.inv_freq"] == "F32"
    qkv = load(gguf_pack, name).model.diffusion_model.blocks[0].attn.qkv_proj
    assert type(qkv).__qualname__ == "GGMLOps.Linear"
    assert qkv.weight.tensor_type.name == qtype
    assert tuple(qkv.weight.shape) == (3 * dims["num_attention_heads"] * dims["attention_head_dim"],
                                       dims["hidden_size"])
    theirs = qkv.cast_bias_weight(torch.zeros(1, dtype=torch.float32))[0]
    reference = gguf.quants.dequantize(np.asarray(qkv.weight.data.numpy()), gguf.GGMLQuantizationType[qtype])
    reference = torch.from_numpy(reference).reshape(theirs.shape)
    # ComfyUI-GGUF multiplies scales and quants in fp16 (its default dequant dtype): a few fp16 roundings apart
    torch.testing.assert_close(theirs, reference, rtol=0, atol=4 * 2 ** -11 * float(reference.abs().max()))


@pytest.mark.parametrize("chunks", [None, 2])
@pytest.mark.parametrize("qtype", FILES)
def test_qkv_equals_the_gguf_layers_own_bit_for_bit(comfy, gguf_pack, gguf_files, qtype, chunks):
    from adaptive_sparse_attention.nodes.comfy_weights import qkv_projection, weight_path

    name, dims, _, _ = gguf_files[qtype]
    H, D = dims["num_attention_heads"], dims["attention_head_dim"]
    attn = load(gguf_pack, name).model.diffusion_model.blocks[0].attn
    assert weight_path(attn.qkv_proj) == "cast"
    x, rope = block_inputs(53, dims["hidden_size"], 3 * dims["rope_inv_freq_len"], torch.float32)
    rows = 16  # 4 chunks, the last of 5 rows
    chunked = [torch.cat(t, dim=2) for t in zip(*(layer_qkv(attn, x[a:a + rows], rope[:, a:a + rows])
                                                   for a in range(0, x.shape[0], rows)))]
    groups = [(0, H)] if chunks is None else [(0, 1), (1, 2)]
    with qkv_projection(attn.qkv_proj, x, H, D) as projection:
        for h0, h1 in groups:
            got = producer.produce_qkv(x, projection, None, H, D, attn.q_norm.weight, attn.k_norm.weight,
                                       attn.q_norm.eps, rope, (h0, h1), chunk_rows=rows)
            for label, ours, layer in zip("qkv", got, chunked):
                assert torch.equal(ours, layer[:, h0:h1]), f"{qtype}: {label} of heads {h0}:{h1} differs"


def test_a_gguf_weight_under_comfyuis_own_cast_is_refused(comfy, gguf_pack, gguf_files):
    """The old path: ComfyUI's cast of a GGUF layer's weight hands back the quantised bytes (here
    a ComfyUI Linear holding the GGUF weight). The producer names the class instead of multiplying."""
    import comfy.ops

    from adaptive_sparse_attention.nodes.comfy_weights import qkv_projection

    qkv = load(gguf_pack, gguf_files["Q8_0"][0]).model.diffusion_model.blocks[0].attn.qkv_proj
    plain = comfy.ops.manual_cast.Linear(qkv.in_features, qkv.out_features, bias=False)
    plain.weight = qkv.weight
    x = torch.randn(8, qkv.in_features)
    with pytest.raises(RuntimeError, match=r"cannot read the weights of a comfy\.ops\.manual_cast\.Linear layer: "
                                           r"ComfyUI's cast_bias_weight returned a GGMLTensor whose storage has "
                                           r"shape \(192, 68\), expected \(192, 64\)"):
        with qkv_projection(plain, x, 2, 32):
            pass


@pytest.mark.parametrize("qtype", FILES)
def test_every_block_exact_samples_what_the_gguf_model_samples(comfy, gguf_pack, gguf_files, qtype):
    """Our node at topk_ratio 1.0, with and without head groups (KJNodes' ``minimax_head_chunks``)."""
    _, nodes = comfy
    name, _, _, source = gguf_files[qtype]
    model = load(gguf_pack, name)
    dense = sample(nodes, model, steps=STEPS)
    float_model = sample(nodes, nodes.UNETLoader().load_unet(source, "default")[0], steps=STEPS)
    error = relative(sample(nodes, sparse(model, **EXACT), steps=STEPS), dense)
    assert error < 1e-5
    assert relative(float_model, dense) > 100 * error  # the quantisation's own effect is far larger
    grouped = sparse(model, **EXACT)
    grouped.model_options.setdefault("transformer_options", {})["minimax_head_chunks"] = 2
    assert relative(sample(nodes, grouped, steps=STEPS), dense) < 1e-5


def test_node_defaults_stay_close_to_the_gguf_model(comfy, gguf_pack, gguf_files, caplog):
    """The node's defaults (min_tokens 0 so that the tiny sequence runs sparse, and the torch reference named:
    on the CPU auto runs the blocks dense) on the Q8_0 file."""
    _, nodes = comfy
    model = load(gguf_pack, gguf_files["Q8_0"][0])
    dense = sample(nodes, model, steps=STEPS)
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        ours = sample(nodes, sparse(model, **{**DEFAULTS, "min_tokens": 0, "kernel": "torch"}), steps=STEPS)
    (_, sparse_steps, _, sparse_blocks), = summaries(caplog)
    assert sparse_steps > 0 and sparse_blocks > 0
    assert relative(ours, dense) < 1e-3  # measured 2.7e-5 (one dense, one sparse step)


@pytest.fixture
def lora_name(comfy):
    """A LoRA file (ComfyUI's lora_up/lora_down format) on the qkv and out projections of every block of `TINY`."""
    import folder_paths
    import safetensors.torch

    base, _ = comfy
    folder = base / "models" / "loras"
    folder.mkdir(parents=True, exist_ok=True)
    folder_paths.add_model_folder_path("loras", str(folder), is_default=True)
    g = torch.Generator().manual_seed(3)
    width, inner, rank = TINY["hidden_size"], TINY["num_attention_heads"] * TINY["attention_head_dim"], 4
    sd = {}
    for i in range(TINY["num_layers"]):
        for layer, (rows, cols) in {"qkv_proj": (3 * inner, width), "out_proj": (width, inner)}.items():
            key = f"diffusion_model.blocks.{i}.attn.{layer}"
            sd[f"{key}.lora_up.weight"] = 0.3 * torch.randn(rows, rank, generator=g)
            sd[f"{key}.lora_down.weight"] = torch.randn(rank, cols, generator=g)
            sd[f"{key}.alpha"] = torch.tensor(float(rank))
    safetensors.torch.save_file(sd, str(folder / "tiny_h3_lora.safetensors"))
    return "tiny_h3_lora.safetensors"


def test_lora_on_a_gguf_model(comfy, gguf_pack, gguf_files, lora_name):
    """LoraLoaderModelOnly on the Q8_0 model: ComfyUI-GGUF applies the patch in its own cast; our node
    (with head groups) samples what the patched GGUF model samples."""
    _, nodes = comfy
    model = load(gguf_pack, gguf_files["Q8_0"][0])
    lora = nodes.LoraLoaderModelOnly().load_lora_model_only(model, lora_name, 1.0)[0]
    dense = sample(nodes, lora, steps=STEPS)
    assert relative(sample(nodes, model, steps=STEPS), dense) > 1e-3  # the patch matters
    ours = sparse(lora, **EXACT)
    ours.model_options.setdefault("transformer_options", {})["minimax_head_chunks"] = 2
    assert relative(sample(nodes, ours, steps=STEPS), dense) < 1e-5


@pytest.mark.skipif(not os.path.isfile(os.path.join(KJNODES, "nodes", "minimax_nodes.py")),
                    reason="set KJNODES_PATH to a ComfyUI-KJNodes checkout to test its node on a GGUF model")
def test_kjnodes_low_vram_attention_on_a_gguf_model(comfy, gguf_pack, gguf_files):
    _, nodes = comfy
    spec = importlib.util.spec_from_file_location("kj_minimax_nodes", os.path.join(KJNODES, "nodes", "minimax_nodes.py"))
    kj = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kj)
    model = load(gguf_pack, gguf_files["Q4_K"][0])
    dense = sample(nodes, model, steps=STEPS)
    low = kj.MiniMaxLowVRAMAttention.execute(model, head_chunks=2).result[0]
    assert relative(sample(nodes, sparse(low, **EXACT), steps=STEPS), dense) < 1e-5


def test_ksampler_with_node_defaults_on_a_q4_k_file(comfy, gguf_pack, gguf_files, caplog):
    """The node as dropped in (its defaults) after UnetLoaderGGUF on the Q4_K file: the run completes.
    At 529 rows every block is below the default min_tokens and runs dense, on our dense override."""
    _, nodes = comfy
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        out = sample(nodes, sparse(load(gguf_pack, gguf_files["Q4_K"][0]), **DEFAULTS))
    assert torch.isfinite(out).all()
    assert summaries(caplog) == [(4, 0, 16, 0)]
