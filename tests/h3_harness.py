"""The H3 block patch's test harness: a tiny H3-shaped model (h3_block.py) run through the hook.

`model_of` builds the model in float64 with non-trivial norm weights; `run_model` runs its block
loop with every block replaced, entered through the hook's DIFFUSION_MODEL wrapper as ComfyUI
does; `reference` runs the same blocks with a given attention, `sparse_oracle` being
`sparse_attention` on each block's own q, k, v. `config` is the tests' SparseConfig (cube, no
warmup, torch backend) with any field changed.
"""
from __future__ import annotations

import torch

from adaptive_sparse_attention import SparseConfig, sparse_attention
from adaptive_sparse_attention.nodes.model_patches import DiffusionModelWrapper, block_hooks
from adaptive_sparse_attention.nodes.block_hook import bind
from h3_block import Block, MiniMaxH3Model, OldBlock, PackedLayout, h3_blocks, layout_of

TOL = dict(rtol=1e-10, atol=1e-10)
PACKED = PackedLayout(5, 4, 16, 16, 3)  # text 5, audio 6, video 4x8x8: S = 267, 4 video cubes of 64


def config(**kw) -> SparseConfig:
    base = dict(tiling="cube", warmup_mode="speed", min_tokens=0, kernel="torch", topk_ratio=0.25)
    base.update(kw)
    return SparseConfig(**base)


def options(step: int = 3, total: int = 10, **extra) -> dict:
    sched = torch.linspace(1.0, 0.0, total + 1, dtype=torch.float64)
    return {"sigmas": sched[step:step + 1].float(), "sample_sigmas": sched.float(), **extra}


def model_of(new: bool, seed: int = 0, **kw) -> MiniMaxH3Model:
    torch.manual_seed(seed)
    model = MiniMaxH3Model(Block if new else OldBlock, **kw).double()
    for block in model.blocks:  # non-trivial norm weights and gates
        for norm in (block.norm1, block.norm2, block.attn.q_norm, block.attn.k_norm):
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    return model.requires_grad_(False)  # as ComfyUI loads it


def set_path(model, key: str, value) -> None:
    *path, last = key.split(".")[1:]  # drop "diffusion_model"
    obj = model
    for p in path:
        obj = obj[int(p)] if p.isdigit() else getattr(obj, p)
    setattr(obj, last, value)


class Executor:
    """Stands in for ComfyUI's WrapperExecutor around H3's _forward (or Raylight's)."""

    def __init__(self, model, fn):
        self.class_obj, self.fn = model, fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def run_model(model, hook, args: dict, new: bool, previous=None, object_patches=None):
    """H3's block loop with every block replaced, entered through the hook's DIFFUSION_MODEL wrapper
    (`new`: current upstream's block forward and loop, else the pinned fork's)."""
    replacements, patches = block_hooks(model, hook, previous or {}, object_patches or {})
    for key, fn in {**(object_patches or {}), **patches}.items():
        set_path(model, key, fn)

    def forward(x, timestep, context, transformer_options, minimax_payload=None):
        patches = {("double_block", i): fn for i, fn in replacements.items()}
        return h3_blocks(model, patches, {**args, "img": args["img"].clone()}, transformer_options, PACKED,
                         "current" if new else "pinned")

    text, t, h, w, audio = PACKED.signature
    x = [torch.zeros(1, 24, t, h, w), torch.zeros(1, 32, 2, audio)]
    context = torch.zeros(1, text, 48)
    bind(model, hook)  # what the ON_PRE_RUN callback does when sampling starts
    try:
        return DiffusionModelWrapper(hook.key)(Executor(model, forward), x, None, context,
                                               args["transformer_options"], minimax_payload={"layout": PACKED})
    finally:
        for block in model.blocks:
            block.attn.__dict__.pop("forward", None)


def reference(model, args: dict, attention_of) -> torch.Tensor:
    h = args["img"].clone()
    for block in model.blocks:
        h = block.run(h, args["t_emb"], args["mod_segments"], args["rope_freqs"], {}, attention_of(block))
    return h


def sparse_oracle(cfg: SparseConfig):
    layout = layout_of(PACKED)

    def attention_of(block):
        def attention(x, rope_freqs=None, transformer_options=None):
            q, k, v = block.attn.qkv(x, rope_freqs)
            out = sparse_attention(q, k, v, layout, cfg)
            return block.attn.out_proj(out[0].transpose(0, 1).reshape(x.shape[0], -1))
        return attention
    return attention_of
