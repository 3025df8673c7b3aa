"""The in-process real-ComfyUI harness: ComfyUI on the CPU with a tiny random-weight MiniMax-H3.

`needs_comfyui` marks a test `comfyui`; conftest.py skips it unless COMFYUI_PATH points at a ComfyUI checkout. `comfy` (a
module-scoped fixture) imports ComfyUI from COMFYUI_PATH with the tiny checkpoint in
its model folder; `sample` runs KSampler on it, `sparse` applies our node with the `SPARSE`
settings, `summaries` reads the run summaries our node logs.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

import comfyui_stubs

COMFYUI = os.environ.get("COMFYUI_PATH", "")
needs_comfyui = pytest.mark.comfyui  # conftest.py skips these unless COMFYUI_PATH holds a checkout
TINY = dict(hidden_size=64, num_layers=2, token_refiner_num_layers=1, num_attention_heads=2, attention_head_dim=32,
            ffn_hidden_size=128, latents_dim=24, audio_latents_dim=32, text_dim=48, timestep_input_dim=32,
            time_embed_hidden_size=64, time_embed_dim=32, rope_inv_freq_len=4)
CKPT = "tiny_h3_random.safetensors"
FRONTEND_ONLY = {"Note", "MarkdownNote"}  # node types of ComfyUI's frontend: never in /object_info, never executed
LATENT = dict(width=256, height=256, length=22)  # 7 latent frames of 8x8 patches: 448 video rows, S = 529
SUMMARY = re.compile(r"adaptive sparse attention: steps (\d+) dense / (\d+) sparse; blocks (\d+) dense / (\d+) sparse")
SPARSE = dict(topk_ratio=0.25, warmup_mode="fidelity", sparse_scope="target-video", tail_granularity="query",
              warmup_ratio=0.25, tiling="reblock", reblock_layout="q_reuse_k", tail="reweight", dense_layers="",
              min_tokens=0, block_size=64, strict=True, dense_attention="fastest", routing_scores="fp32",
              precision="auto", plan_reuse="off", measure_error=True, error_target=0.0,
              kernel="torch")  # on the CPU auto runs the sparse blocks dense: the reference is named



def save_tiny_h3(path: Path, dims: dict | None = None, **extra) -> None:
    """A random-weight H3 of the tiny shape `TINY` (or `dims`), as ComfyUI's loader expects it
    (`extra`: more constructor arguments, e.g. current upstream's gate_compress=True)."""
    import comfy.ops
    import safetensors.torch
    from comfy.ldm.minimax.model import MiniMaxH3Model

    dims = TINY if dims is None else dims
    model = MiniMaxH3Model(**dims, **extra, operations=comfy.ops.disable_weight_init)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for key, p in model.state_dict().items():
        scale = 0.1 if p.dim() > 1 else 0.02
        sd[key] = torch.randn(p.shape, generator=g) * scale + (1.0 if key.endswith("norm.weight") else 0.0)
    sd["rope.inv_freq"] = 1.0 / (100.0 ** (torch.arange(dims["rope_inv_freq_len"]) / dims["rope_inv_freq_len"]))
    safetensors.torch.save_file(sd, str(path))


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    """ComfyUI imported in this process on the CPU, with the tiny checkpoint in its model folder."""
    base = tmp_path_factory.mktemp("comfy_base")
    (base / "stubs").mkdir()
    (base / "stubs" / "sitecustomize.py").write_text(comfyui_stubs.STUBS)
    comfyui_stubs.apply()
    sys.path.insert(0, COMFYUI)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    import folder_paths

    (base / "models" / "diffusion_models").mkdir(parents=True)
    save_tiny_h3(base / "models" / "diffusion_models" / CKPT)
    folder_paths.add_model_folder_path("diffusion_models", str(base / "models" / "diffusion_models"), is_default=True)
    folder_paths.set_output_directory(str(base / "output"))
    import nodes

    return base, nodes


def sample(nodes, model, cfg: float = 3.0, steps: int = 4):
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    latent = EmptyMiniMaxH3LatentAV.execute(**LATENT).result[0]
    g = torch.Generator().manual_seed(1)
    pos, neg = [[torch.randn(1, 7, 48, generator=g), {}]], [[torch.randn(1, 7, 48, generator=g), {}]]
    out = nodes.common_ksampler(model, 7, steps, cfg, "euler", "simple", pos, neg, latent)[0]["samples"]
    return torch.cat([t.flatten() for t in out.unbind()])


def sparse(model, **changes):
    from adaptive_sparse_attention.nodes.sparse_node import AdaptiveSparseAttentionH3

    return AdaptiveSparseAttentionH3.execute(model=model, **{**SPARSE, **changes}).result[0]


def summaries(caplog) -> list[tuple[int, ...]]:
    return [tuple(map(int, m.groups())) for r in caplog.records if (m := SUMMARY.search(r.getMessage()))]


def layer_qkv(attn, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [1, H, S, D] as the model's own Attention.forward hands them to attention."""
    import comfy.ldm.minimax.model as h3

    seen = {}

    def capture(q, k, v, heads, **kwargs):
        seen.update(q=q.take(), k=k.take(), v=v.take())
        return torch.zeros(1, x.shape[0], heads * attn.head_dim, dtype=x.dtype)
    original = h3.optimized_attention
    h3.optimized_attention = capture
    try:
        attn(x, rope_freqs=rope, transformer_options={})
    finally:
        h3.optimized_attention = original
    return seen["q"], seen["k"], seen["v"]


CORE_SPARSE = "comfy_extras.nodes_sparse_attention"  # ComfyUI's core "Model Sparse Attention" (newer than the pin)


@contextmanager
def core_sparse_node(form: str, selection: dict) -> Iterator[Callable | None]:
    """apply(model) of ComfyUI's core sparse node: the real one with `selection` where this ComfyUI has it
    (None for the form "chains", which only the stand-in has), else core_sparse_standin.py in `form`."""
    if importlib.util.find_spec(CORE_SPARSE) is not None:
        real = importlib.import_module(CORE_SPARSE)

        def apply(model):
            return real.BlockSparseAttention.execute(model, selection=selection, start_percent=0.2,
                                                     end_percent=1.0).result[0]
        yield None if form == "chains" else apply
        return
    spec = importlib.util.spec_from_file_location(CORE_SPARSE, Path(__file__).with_name("core_sparse_standin.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[CORE_SPARSE] = module
    try:
        spec.loader.exec_module(module)
        yield functools.partial(module.apply_block_sparse_attention, form=form)
    finally:
        del sys.modules[CORE_SPARSE]
