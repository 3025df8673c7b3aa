"""A stand-in of today's upstream H3 attention (Comfy-Org/ComfyUI, comfy/ldm/minimax/model.py at 01a56b76 and
comfy/ldm/modules/attention.py at 05080f60), beside the pinned fork's in h3_block.py.

What differs from the fork: each attention module has a ``comfy_attention`` (ComfyAttention) whose
``function`` the checkpoint sets through a ``<prefix>comfy_attention.config`` entry (JSON bytes, e.g.
``{"attention": "comfy_kitchen_int8"}``), and its forward hands q, k, v to ``optimized_attention`` in
single-owner containers with ``preferred_attention=self.comfy_attention``. ComfyUI's ``wrap_attn`` pops
``preferred_attention``; an ``optimized_attention_override`` in transformer_options wins (called with the
wrapped function and the containers' tensors), else the module's function runs, else the launch's.
Written from that code, without ComfyUI; attention functions compute SDPA in ComfyUI's shapes.
"""
from __future__ import annotations

import functools
import json
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from attention_standins import ATTENTION
from h3_block import Attention, Block, MiniMaxH3Model

KERNELS: dict[str, Callable] = {}  # ComfyAttention's config name -> the function where it runs on this device


class ComfyAttention(nn.Module):
    """A module's own attention choice, read from the checkpoint (``_load_from_state_dict``)."""

    def __init__(self):
        super().__init__()
        self.config = None
        self.function = None

    def _load_from_state_dict(self, state_dict, prefix, *args):
        self.config = self.function = None
        metadata = state_dict.pop(prefix + "config", None)
        if metadata is not None:
            config = json.loads(metadata.numpy().tobytes())
            if config.get("attention") == "comfy_kitchen_int8":
                self.config = config
                self.function = KERNELS.get("comfy_kitchen_int8")
        super()._load_from_state_dict(state_dict, prefix, *args)


def config_entry(method: str) -> torch.Tensor:
    """A ``comfy_attention.config`` entry of a checkpoint choosing `method`."""
    return torch.tensor(list(json.dumps({"attention": method}).encode("utf-8")), dtype=torch.uint8)


class Container:
    """ComfyUI's AttentionTensorContainer: a tensor handed over once."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def take(self) -> torch.Tensor:
        tensor, self.tensor = self.tensor, None
        return tensor


def wrap_attn(func: Callable) -> Callable:
    """ComfyUI's wrap_attn (today's): override first, then the module's preferred function, then `func`."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        preferred = kwargs.pop("preferred_attention", None)
        if isinstance(args[0], Container):
            args = tuple(c.take() for c in args[:3]) + args[3:]
        if "_inside_attn_wrapper" not in kwargs:
            kwargs["_inside_attn_wrapper"] = True
            override = (kwargs.get("transformer_options") or {}).get("optimized_attention_override")
            if override is not None:
                return override(func, *args, **kwargs)
            if preferred is not None and preferred.function is not None:
                return preferred.function(*args, **kwargs)
        return func(*args, **kwargs)
    return wrapper


def sdpa_function(name: str, calls: list, factor: float = 1.0, module: str = ATTENTION) -> Callable:
    """A ComfyUI attention function named `name` (wrapped): SDPA times `factor`; each call appends the
    kwargs it got to `calls`."""
    def inner(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
              **kwargs):
        calls.append(kwargs)
        if not skip_reshape:
            q, k, v = (t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v) * factor
        return out if skip_output_reshape else out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
    inner.__module__, inner.__qualname__, inner.__name__ = module, name, name
    return wrap_attn(inner)


LAUNCH_CALLS: list = []
optimized_attention = sdpa_function("attention_pytorch", LAUNCH_CALLS)  # what the launch bound at import


class UpstreamAttention(Attention):
    """Today's attention module: ``comfy_attention`` and ``optimized_attention(..., preferred_attention=...)``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.comfy_attention = ComfyAttention()

    def forward(self, x, rope_freqs=None, transformer_options={}):  # noqa: B006
        q, k, v = self.qkv(x, rope_freqs)
        out = optimized_attention(Container(q), Container(k), Container(v), self.heads,
                                  preferred_attention=self.comfy_attention, mask=None, skip_reshape=True,
                                  transformer_options=transformer_options)
        return self.out_proj(out.squeeze(0))


class UpstreamBlock(Block):
    """Today's block: the fork's (h3_block.Block, which takes ``attention``) with today's attention module."""

    def __init__(self, hidden: int = 32, heads: int = 3, head_dim: int = 32, t_dim: int = 8,
                 gate_compress: bool = False):
        super().__init__(hidden, heads, head_dim, t_dim, gate_compress)
        self.attn = UpstreamAttention(hidden, heads, head_dim, gate_compress)


class UpstreamH3Model(MiniMaxH3Model):
    """Named like ComfyUI's model class; its module binds `optimized_attention` as H3's module does."""


UpstreamH3Model.__name__ = UpstreamH3Model.__qualname__ = "MiniMaxH3Model"


def upstream_model(seed: int, layers: int = 2, choose: str | None = None) -> UpstreamH3Model:
    """Today's model in float64, loaded from a checkpoint whose attention modules choose `choose` (None:
    no ``comfy_attention.config`` entries), as ComfyUI loads it (no grad)."""
    torch.manual_seed(seed)
    model = UpstreamH3Model(UpstreamBlock, layers=layers).double()
    sd = model.state_dict()
    for i in range(layers):
        for norm in ("norm1", "norm2", "attn.q_norm", "attn.k_norm"):
            sd[f"blocks.{i}.{norm}.weight"] = torch.rand_like(sd[f"blocks.{i}.{norm}.weight"]) + 0.5
        if choose is not None:
            sd[f"blocks.{i}.attn.comfy_attention.config"] = config_entry(choose)
    model.load_state_dict(sd)
    return model.requires_grad_(False)
