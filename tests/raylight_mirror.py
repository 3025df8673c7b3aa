"""Raylight's sequence-parallel (USP) path for MiniMax-H3, as call contracts, over torch.distributed.

Written from Raylight's and xFuser's code (komikndr/raylight, xdit-project/xDiT), without Ray or
xFuser, so the adapter is tested against the calls it really receives:

- raylight distributed_modules/inner_attention (registry.py, dispatcher.py): the processor sits in
  ``transformer_options["raylight_inner_attention"]``; a context variable holds (processor,
  transformer_options) around the xFuser call; xFuser's ring-attention function is replaced by a
  dispatcher that calls ``processor(dense, q, k, v, transformer_options=..., **ring_keywords)``,
  where ``dense(q, k, v, **ring_keywords)`` is the original function; a processor whose
  ``supports_ring`` is false is refused when the ring group has more than one rank.
- raylight distributed_modules/attention.py (make_xfuser_attention): q, k, v [B, H, s, D] are
  handed to xFuser as [B, s, H, D]; the output comes back the same way.
- xfuser core/long_ctx_attention/hybrid/attn_layer.py (xFuserLongContextAttention.forward): an
  all-to-all gives rank r all rows of head chunk r, ring_attn_fn runs with `RING_KEYWORDS`, and an
  all-to-all gives the rows back.
- raylight diffusion_models/minimax/xdit_context_parallel.py (usp_attn_forward, usp_dit_forward):
  q, k, v of the rank's rows; the sequence, its rope rows and mod_segments are padded with zeros
  to a multiple of the world size and split per rank; a ("dit", "double_block", i) replacement
  gets {"img", "t_emb", "mod_segments", "rope_freqs", "transformer_options"}, and its
  original_block calls ``block(img, t_emb, mod_segments, rope_freqs, transformer_options=...)``;
  the rows are all-gathered at the end.
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

INNER_ATTENTION_KEY = "raylight_inner_attention"
_ACTIVE: ContextVar = ContextVar("raylight_inner_attention", default=None)


def ring_keywords(group: Any) -> dict:
    """The keywords xFuser's forward passes to its ring-attention function (Ulysses only: ring group of 1)."""
    return dict(dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                deterministic=False, return_attn_probs=False, group=group, attn_type="TORCH", attn_processor=None,
                attn_layer=None, joint_tensor_key=None, joint_tensor_value=None, joint_strategy="none",
                q_descale=None, k_descale=None, v_descale=None)


def dense_ring_attention(q, k, v, **keywords):
    """xFuser's attention with a ring of one rank: dense over every row it holds (padding rows included)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def gather_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, s, H, D] rows of every rank -> [B, S, H/P, D] all rows of this rank's head chunk."""
    world, rank = dist.get_world_size(), dist.get_rank()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    h = x.shape[2] // world
    return torch.cat(parts, dim=1)[:, :, rank * h:(rank + 1) * h].contiguous()


def scatter_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H/P, D] of every rank -> [B, s, H, D] this rank's rows of all heads."""
    world, rank = dist.get_world_size(), dist.get_rank()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    s = x.shape[1] // world
    return torch.cat(parts, dim=2)[:, rank * s:(rank + 1) * s]


class XFuserAttention:
    """xFuser's long-context attention with Raylight's inner-attention dispatcher installed."""

    def __init__(self, ring_world_size: int = 1):
        self.ring_world_size = ring_world_size
        dense = dense_ring_attention

        def dispatch(q, k, v, *args, **keywords):
            active = _ACTIVE.get()
            if active is None:
                return dense(q, k, v, *args, **keywords)
            processor, options = active
            return processor(lambda a, b, c, **o: dense(a, b, c, *args, **o), q, k, v,
                             transformer_options=options, **keywords)

        self.ring_attn_fn = dispatch

    def __call__(self, query, key, value, transformer_options: dict):
        processor = transformer_options.get(INNER_ATTENTION_KEY)
        if processor is not None and self.ring_world_size != 1 and not getattr(processor, "supports_ring", False):
            raise RuntimeError("inner-attention processor does not support ring attention")
        token = _ACTIVE.set(None if processor is None else (processor, transformer_options))
        try:
            q, k, v = (gather_heads(t) for t in (query, key, value))
            out = self.ring_attn_fn(q, k, v, **ring_keywords(None))
        finally:
            _ACTIVE.reset(token)
        return scatter_rows(out)


def usp_attention(attn: torch.nn.Module, xfuser: XFuserAttention):
    """Raylight's replacement of one block's ``attn.forward`` (bound to `attn`)."""
    def forward(x, rope_freqs=None, transformer_options={}):  # noqa: B006
        q, k, v = attn.qkv(x, rope_freqs)  # [1, H, s, D] each, as Raylight hands them to make_xfuser_attention
        out = xfuser(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), transformer_options)
        return attn.out_proj(out[0].reshape(x.shape[0], -1))
    return forward


def pad_rows(t: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    extra = -t.shape[dim] % world
    if not extra:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def usp_forward(model: torch.nn.Module, args: dict):
    """Raylight's H3 ``_forward`` replacement reduced to its block loop; `args` are one call's block args."""
    def forward(x, timestep, context, transformer_options, minimax_payload=None):
        world, rank = dist.get_world_size(), dist.get_rank()
        rows = args["img"].shape[0]
        h, rope = pad_rows(args["img"].clone(), 0, world), pad_rows(args["rope_freqs"], 1, world)
        s = h.shape[0] // world
        lo, hi = rank * s, (rank + 1) * s
        segments = [(max(a, lo) - lo, min(b, hi) - lo, row) for a, b, row in args["mod_segments"]
                    if max(a, lo) < min(b, hi)]
        h, rope = h[lo:hi], rope[:, lo:hi]
        replace = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(model.blocks):
            call = {"img": h, "t_emb": args["t_emb"], "mod_segments": segments, "rope_freqs": rope,
                    "transformer_options": transformer_options}
            if ("double_block", i) in replace:
                def original(a, block=block):
                    return {"img": block(a["img"], a["t_emb"], a["mod_segments"], a["rope_freqs"],
                                         transformer_options=a["transformer_options"])}
                h = replace[("double_block", i)](call, {"original_block": original})["img"]
            else:
                h = block(h, args["t_emb"], segments, rope, transformer_options=transformer_options)
        parts = [torch.empty_like(h) for _ in range(world)]
        dist.all_gather(parts, h.contiguous())
        return torch.cat(parts)[:rows]
    return forward


def set_inner_attention(model_patcher: Any, processor: Any) -> Any:
    """Raylight's registry.set_inner_attention: a clone whose transformer_options hold the processor."""
    clone = model_patcher.clone()
    options = clone.model_options.copy()
    options["transformer_options"] = {**options.get("transformer_options", {}), INNER_ATTENTION_KEY: processor}
    clone.model_options = options
    return clone
