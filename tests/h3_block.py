"""A tiny H3-shaped DiT block written from the documented block contract (no ComfyUI).

Two ComfyUI versions are mirrored: the pinned fork (upstream 0f1fa67a) and the newest stored
upstream (Comfy-Org/ComfyUI, comfy/ldm/minimax/model.py at 2c64d4aa); `Block`/`OldBlock` and
`h3_blocks` say what differs. It follows ComfyUI's MiniMax-H3 block as documented: fused qkv_proj (no bias),
per-head RMSNorm of q and k, split-half RoPE on the first rot_dim dims from a [1, S, 1, r/2, 2, 2]
rotation table, dense attention, out_proj, adaLN modulation per (start, stop, row) segment and
gated residuals accumulated in place into the block input. Written independently of
backend/producer.py so the tests compare against a second implementation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adaptive_sparse_attention.backend.layout import SequenceLayout


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_table(seq: int, rot_dim: int, dtype) -> torch.Tensor:
    pos = torch.arange(seq, dtype=torch.float64).view(-1, 1)
    ang = pos * (1.0 / (50.0 ** (torch.arange(rot_dim // 2, dtype=torch.float64) / (rot_dim // 2))))
    c, s = torch.cos(ang), torch.sin(ang)
    return torch.stack([c, -s, s, c], dim=-1).reshape(1, seq, 1, rot_dim // 2, 2, 2).to(dtype)


def norm_rope(x: torch.Tensor, norm: RMSNorm, table: torch.Tensor) -> torch.Tensor:
    """x [S, H, D]: RMSNorm then rotate pairs (i, i + r/2) of the first r dims."""
    y = norm(x)
    r = table.shape[-3] * 2
    a, b = y[..., : r // 2], y[..., r // 2: r]
    m = table[0, :, 0]  # [S, r/2, 2, 2]
    first = m[..., 0, 0].unsqueeze(1) * a + m[..., 0, 1].unsqueeze(1) * b
    second = m[..., 1, 0].unsqueeze(1) * a + m[..., 1, 1].unsqueeze(1) * b
    return torch.cat([first, second, y[..., r:]], dim=-1)


class Attention(nn.Module):
    """`gate_compress` (current upstream): a bias-free to_gate_compress Linear(hidden, H * D) that
    the dense forward does not use (distilled FastH3 checkpoints carry it); else None."""

    def __init__(self, hidden: int, heads: int, head_dim: int, gate_compress: bool = False):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv_proj = nn.Linear(hidden, 3 * heads * head_dim, bias=False)
        self.q_norm, self.k_norm = RMSNorm(head_dim), RMSNorm(head_dim)
        self.out_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.to_gate_compress = nn.Linear(hidden, heads * head_dim, bias=False) if gate_compress else None

    def qkv(self, x, rope_freqs):
        s = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.heads * self.head_dim, dim=-1)
        q = norm_rope(q.view(s, self.heads, self.head_dim), self.q_norm, rope_freqs)
        k = norm_rope(k.view(s, self.heads, self.head_dim), self.k_norm, rope_freqs)
        v = v.reshape(s, self.heads, self.head_dim)
        return (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))

    def forward(self, x, rope_freqs=None, transformer_options={}):  # noqa: B006
        q, k, v = self.qkv(x, rope_freqs)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out[0].transpose(0, 1).reshape(x.shape[0], -1))


class Block(nn.Module):
    """Current upstream: forward takes `attention` (None means self.attn)."""

    def __init__(self, hidden: int = 32, heads: int = 3, head_dim: int = 32, t_dim: int = 8,
                 gate_compress: bool = False):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.attn = Attention(hidden, heads, head_dim, gate_compress)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))
        self.adaln = nn.Linear(t_dim, 6 * hidden)

    def run(self, x, t_emb, mod_segments, rope_freqs, transformer_options, attention):
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaln(t_emb).chunk(6, dim=-1)
        h = self.norm1(x)
        for a, b, row in mod_segments:
            h[a:b] = h[a:b] * (1 + scale_a[row]) + shift_a[row]
        out = attention(h, rope_freqs=rope_freqs, transformer_options=transformer_options)
        for a, b, row in mod_segments:
            x[a:b].addcmul_(out[a:b], gate_a[row])
        h = self.norm2(x)
        for a, b, row in mod_segments:
            h[a:b] = h[a:b] * (1 + scale_m[row]) + shift_m[row]
        out = self.mlp(h)
        for a, b, row in mod_segments:
            x[a:b].addcmul_(out[a:b], gate_m[row])
        return x

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):  # noqa: B006
        return self.run(x, t_emb, mod_segments, rope_freqs, transformer_options, attention or self.attn)


class OldBlock(Block):
    """Older upstream: no `attention` argument; the block always calls self.attn."""

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}):  # noqa: B006
        return self.run(x, t_emb, mod_segments, rope_freqs, transformer_options, self.attn)


class MiniMaxH3Model(nn.Module):
    """Named like ComfyUI's model class so the patch's model check accepts it."""

    def __init__(self, block_cls=Block, layers: int = 2, **kw):
        super().__init__()
        self.blocks = nn.ModuleList([block_cls(**kw) for _ in range(layers)])


class PackedLayout:
    """The fields of ComfyUI's PackedLayout the patch reads (segments, position_ids, signature),
    with its constructor's signature: (text_len, latent_t, latent_h, latent_w, audio_t)."""

    def __init__(self, text_len: int, latent_t: int, latent_h: int, latent_w: int, audio_t: int,
                 keyframes=None, refs=None):
        t, h, w = latent_t, latent_h // 2, latent_w // 2
        audio = 2 * audio_t  # stereo, channel-major
        rows = [torch.stack([torch.arange(text_len, dtype=torch.float64), torch.zeros(text_len), torch.zeros(text_len)], 1),
                torch.stack([torch.arange(audio, dtype=torch.float64) % audio_t, torch.zeros(audio),
                             (torch.arange(audio) >= audio_t).double()], 1)]
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        rows.append(torch.stack([tt.reshape(-1) + text_len, hh.reshape(-1), ww.reshape(-1)], 1).double())
        self.position_ids = torch.cat(rows)
        self.segments = [(0, text_len, "text"), (text_len, text_len + audio, "audio"),
                         (text_len + audio, text_len + audio + t * h * w, "video")]
        self.signature = (text_len, latent_t, latent_h, latent_w, audio_t)
        self.seq_len = text_len + audio + t * h * w


def block_args(block: Block, packed: PackedLayout, seed: int, new: bool, dtype=torch.float64) -> dict:
    """Block args as H3's forward builds them (current upstream adds "layout")."""
    g = torch.Generator().manual_seed(seed)
    hidden = block.norm1.weight.shape[0]
    s = packed.seq_len
    text, audio = packed.segments[0][1], packed.segments[1][1] - packed.segments[1][0]
    args = {"img": torch.randn(s, hidden, generator=g, dtype=dtype),
            "t_emb": torch.randn(3, block.adaln.in_features, generator=g, dtype=dtype),
            "mod_segments": [(0, text, 1), (text, text + audio, 2), (text + audio, s, 0)],
            "rope_freqs": rope_table(s, 3 * block.attn.head_dim // 4, dtype),  # H3 rotates 96 of 128 dims
            "transformer_options": {}}
    if new:
        args["layout"] = packed
    return args


def block_wrap(block: Block, new: bool):
    """The `original_block` H3's forward hands to a replacement."""
    def run(args):
        kwargs = {"attention": args.get("attention")} if new else {}
        return {"img": block(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                             transformer_options=args["transformer_options"], **kwargs)}
    return run


def layout_of(packed: PackedLayout) -> SequenceLayout:
    return SequenceLayout.from_packed(packed)


UPSTREAMS = ("pinned", "current")


def h3_blocks(model: MiniMaxH3Model, patches: dict, args: dict, transformer_options: dict,
              packed: PackedLayout, upstream: str) -> torch.Tensor:
    """H3's block loop (its forward after the embeddings) as `upstream` has it.

    "current": the forward puts the layout in ``transformer_options["minimax_h3_layout"]`` and,
    before each block, its index in ``transformer_options["block_index"]`` (the caller's dict,
    not a copy); the block args carry "layout" and the original block passes on
    ``args["attention"]``. "pinned": none of these. `patches`: ("double_block", i) -> replacement;
    a "layout" already in `args` stands for the one H3 computed (tests give a wrong one there).
    """
    if upstream not in UPSTREAMS:
        raise ValueError(f"upstream={upstream!r}: expected one of {UPSTREAMS}")
    current = upstream == "current"
    if current:
        transformer_options["minimax_h3_layout"] = packed
    h = args["img"]
    for i, block in enumerate(model.blocks):
        if current:
            transformer_options["block_index"] = i
        call = {**({"layout": packed} if current else {}), **args, "img": h, "transformer_options": transformer_options}
        if ("double_block", i) in patches:
            h = patches[("double_block", i)](call, {"original_block": block_wrap(block, current)})["img"]
        else:
            h = block(h, args["t_emb"], args["mod_segments"], args["rope_freqs"], transformer_options=transformer_options)
    return h


def malloc_graph_standin(monkeypatch) -> list:
    """Today's upstream `comfy.model_prefetch.pause_malloc_graph` (the pinned fork has none) as a stand-in:
    returns the list whose length is the pause depth at any moment (0: inside the recorded allocations)."""
    import sys
    import types

    depth: list = []

    class Pause:
        def __enter__(self):
            depth.append(1)

        def __exit__(self, *exc):
            depth.pop()

    monkeypatch.setitem(sys.modules, "comfy.model_prefetch", types.SimpleNamespace(pause_malloc_graph=Pause))
    return depth
