"""Structured synthetic MiniMax-H3 attention inputs ("scenes") for benchmarks and tests.

Random Gaussian Q/K make every block look alike, so they cannot tell a good router from a bad
one. A scene instead builds Q/K/V from a small world model shaped like what H3 attends over:

- Sequence `[text | audio | video]` as H3 packs it (t-major video rows of a (T, H, W) grid).
- Video content: per shot a background field (low-frequency plane waves plus a finer texture,
  in world coordinates, so a camera pan slides it across the screen) and moving elliptical objects
  (each with its own embedding; later objects occlude earlier ones). A cut starts a new shot
  with a new background, new objects and a new pan. Text tokens are random "words", a few of
  which name an object (share its embedding); audio tokens follow a smooth random walk aligned
  in time with the video frames.
- Heads come in four kinds, assigned round-robin: `local` (RoPE-like positional kernel in t, h
  and w: attends space-time neighbours), `temporal` (same screen position, broad in time),
  `semantic` (content similarity: the same object across frames and the words naming it) and
  `context` (video queries lean on text and audio keys). Every head mixes in the other parts
  with smaller weights and a per-token noise term, so no head is a clean pattern.
- q and k are assembled from orthogonal sub-spaces (RoPE-like rotary features of (t, h, w),
  rotated content, a context axis, per-token noise) and then RMS-normalised per head and scaled
  by a per-head gain, as H3 does with its per-head RMSNorm: |q| = |k| = gain * sqrt(D) for every
  token. V is a per-head projection of the content plus noise (not normalised).

Calibration. Each head's share of the context axis in its video queries is solved for (by
bisection on 64 probe queries) so that video queries put a set share of their mass on the
context prefix: 13% for most kinds, 45% for `context` heads, about 21% on average (published
range for H3: 16-26%). Head widths scale with the frame and clip size. The gain (1.12) and the
mixing shares were tuned so that fixed 64-token cube tiles at ratio 0.1 capture about 0.69 of
the attention mass of video queries (the published fixed-block recall on real H3), averaged
over `pan` and `cuts`: 0.69 at `cpu-small` (checked by `tests/test_scenes.py`), 0.75 at h3-5s and
0.69 at h3-10s (4-head samples), while the best 10% of video tokens per query would capture
0.79-0.93, leaving room for better tilings. `gaussian` is the unstructured control.

Denoising drift. `make_scene(..., noise=s)` gives the scene as a denoising step at flow sigma s
sees it: the content of every generated token (video and audio; text is clean conditioning) is
x_s = (1 - s) x_0 + s e, with x_0 the clean content above and e one fixed Gaussian draw per token
(its own generator, so one seed's trajectory shares its heads, positions and noise at every s), and
Q/K/V are assembled from x_s exactly as from x_0 (rotated content, RMS-normalised with the
positional, context and per-token parts). Positions (RoPE) do not move; following s down a sigma
schedule moves Q/K the way a flow-matching trajectory moves them: fast where s changes fast.

All random draws use a CPU generator seeded per scene, so a seed gives the same scene on every
device up to floating-point rounding; the per-head assembly runs on the target device one head
at a time, writing straight into the output dtype (bf16 at full H3 size fits on one GPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from ..errors import SparseAttentionError
from ..backend.layout import SequenceLayout

HEAD_KINDS = ("local", "temporal", "semantic", "context")
SCENES = ("pan", "cuts", "gaussian")
STRUCTURED_SCENES = ("pan", "cuts")
CONTENT_DIM = 32
NOISE_DIM = 32
TIME_EXP = 1.0
SMOOTH_WAVES = 6
TEXTURE_WAVES = 4
TEXTURE_AMP = 0.6
CALIBRATION_ROWS = 64  # video queries per head used to solve for the context share


@dataclass(frozen=True)
class SceneSize:
    """Token counts of a scene: text and audio prefix, video grid (T, H, W), heads, head dim."""

    text: int
    audio: int
    grid: tuple[int, int, int]
    heads: int
    head_dim: int

    @property
    def total(self) -> int:
        return self.text + self.audio + self.grid[0] * self.grid[1] * self.grid[2]

    def layout(self) -> SequenceLayout:
        a, b = self.text, self.text + self.audio
        return SequenceLayout.from_segments([(0, a, "text"), (a, b, "audio"), (b, self.total, "video", self.grid)])


# H3's shapes: a 1344x768 video has 24 x 42 latent rows per frame; the model has 56 heads of 128.
SIZES = {
    "demo": SceneSize(64, 96, (6, 16, 24), 2, 64),
    "cpu-small": SceneSize(64, 96, (8, 16, 24), 4, 128),
    "h3-5s": SceneSize(256, 414, (37, 24, 42), 56, 128),
    "h3-10s": SceneSize(256, 810, (72, 24, 42), 56, 128),
    "h3-14s": SceneSize(256, 1224, (102, 24, 42), 56, 128),
    # long clips: 736 frames (30.3 s; 217 latent frames, S 221,422) and 1,450 frames (59.7 s; 427, S 435,532)
    "h3-30s": SceneSize(256, 2430, (217, 24, 42), 56, 128),
    "h3-60s": SceneSize(256, 4860, (427, 24, 42), 56, 128),
}


MAX_FEW_HEADS = 8  # `with_heads`: each head kind twice, little enough for a CPU at H3 size


def with_heads(size: str, heads: int | None, command: str) -> SceneSize:
    """SIZES[size], with `heads` heads instead when given (1-8): the scenes cycle through the four
    head kinds, so 4 heads hold one of each and a head's error is what it is at 56 heads; H3 sizes
    then run on a CPU too. Raises ValueError naming `command`'s --heads for any other count."""
    if heads is None:
        return SIZES[size]
    if not 1 <= heads <= MAX_FEW_HEADS:
        raise SparseAttentionError(f"{command}: --heads {heads} is not allowed: expected 1 to {MAX_FEW_HEADS}")
    return replace(SIZES[size], heads=heads)


@dataclass(frozen=True)
class HeadKind:
    """How one kind of head mixes its parts (squared shares of the unit q/k direction).

    pos, content, noise: relative shares of the rotary positional part, the rotated content and
    the per-token noise; t_scale / s_scale: positional width in frames / tokens at `cpu-small`
    size (larger = broader); ctx_mass: share of a video query's attention mass that goes to the
    context prefix (the generator solves for the context-axis share that gives it, see
    `context_share`); gain: the RMSNorm weight (logits are gain^2 * sqrt(D) * cos(q, k)).
    """

    pos: float
    t_scale: float
    s_scale: float
    content: float
    noise: float
    ctx_mass: float
    gain: float


KIND_WEIGHTS = {
    "local": HeadKind(pos=0.6, t_scale=1.5, s_scale=2.0, content=0.2, noise=0.15, ctx_mass=0.13, gain=1.12),
    "temporal": HeadKind(pos=0.6, t_scale=12.0, s_scale=1.0, content=0.2, noise=0.15, ctx_mass=0.13, gain=1.12),
    "semantic": HeadKind(pos=0.1, t_scale=4.0, s_scale=6.0, content=0.7, noise=0.15, ctx_mass=0.13, gain=1.12),
    "context": HeadKind(pos=0.2, t_scale=3.0, s_scale=4.0, content=0.4, noise=0.15, ctx_mass=0.45, gain=1.12),
}
CONTEXT_KEY_SHARE = 0.5  # share of a context key's direction on the context axis


@dataclass
class Scene:
    """Generated inputs: q, k, v [1, H, S, D], their layout and the kind of every head."""

    name: str
    seed: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: SequenceLayout
    head_kinds: tuple[str, ...]


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def _shots(T: int, cuts: int) -> list[tuple[int, int]]:
    edges = [round(i * T / (cuts + 1)) for i in range(cuts + 2)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def video_content(grid: tuple[int, int, int], cuts: int, gen: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Unit content vectors [T*H*W, C] of a video with smooth backgrounds, moving objects, pans
    and `cuts`; also the object embeddings (text words may name them)."""
    T, H, W = grid
    out = torch.empty(T, H, W, CONTENT_DIM)
    yy, xx = torch.meshgrid(torch.arange(H, dtype=torch.float32), torch.arange(W, dtype=torch.float32), indexing="ij")
    objects: list[torch.Tensor] = []
    size = math.sqrt(H * W)
    for t0, t1 in _shots(T, cuts):
        base = torch.randn(CONTENT_DIM, generator=gen)
        waves = SMOOTH_WAVES + TEXTURE_WAVES
        wavelen = size * torch.cat([0.35 + 0.9 * torch.rand(SMOOTH_WAVES, generator=gen),
                                    0.08 + 0.15 * torch.rand(TEXTURE_WAVES, generator=gen)])
        angle = 2 * math.pi * torch.rand(waves, generator=gen)
        kx, ky = 2 * math.pi / wavelen * torch.cos(angle), 2 * math.pi / wavelen * torch.sin(angle)
        phase = 2 * math.pi * torch.rand(waves, generator=gen)
        amp = torch.randn(waves, CONTENT_DIM, generator=gen)
        amp[:SMOOTH_WAVES] *= 0.8
        amp[SMOOTH_WAVES:] *= TEXTURE_AMP
        pan = (torch.rand(2, generator=gen) - 0.5) * 0.12 * size  # tokens per frame (x, y)
        n_obj = 3
        centre = torch.rand(n_obj, 2, generator=gen) * torch.tensor([W, H])
        vel = (torch.rand(n_obj, 2, generator=gen) - 0.5) * 0.15 * size
        radius = (0.08 + 0.12 * torch.rand(n_obj, 2, generator=gen)) * torch.tensor([W, H])
        emb = torch.randn(n_obj, CONTENT_DIM, generator=gen) * 1.6
        objects.extend(emb)
        for t in range(t0, t1):
            dt = float(t - t0)
            wx, wy = xx + pan[0] * dt, yy + pan[1] * dt
            field = torch.cos(kx.view(-1, 1, 1) * wx + ky.view(-1, 1, 1) * wy + phase.view(-1, 1, 1))
            frame = base + torch.einsum("mhw,mc->hwc", field, amp)
            for o in range(n_obj):
                c = centre[o] + vel[o] * dt
                inside = ((xx - c[0]) / radius[o, 0]) ** 2 + ((yy - c[1]) / radius[o, 1]) ** 2 <= 1.0
                frame[inside] = emb[o] + 0.25 * frame[inside]
            out[t] = frame
    return _unit(out.reshape(T * H * W, CONTENT_DIM)), objects


def context_content(text: int, audio: int, objects: list[torch.Tensor], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit content of text tokens (random words, some naming objects) and audio tokens (a
    smooth random walk)."""
    words = torch.randn(text, CONTENT_DIM, generator=gen)
    named = torch.randperm(text, generator=gen)[: min(text // 16, len(objects))]
    for i, row in enumerate(named.tolist()):
        words[row] = objects[i] + 0.6 * torch.randn(CONTENT_DIM, generator=gen)
    steps = torch.randn(audio, CONTENT_DIM, generator=gen) * 0.3
    sound = torch.randn(1, CONTENT_DIM, generator=gen) + torch.cumsum(steps, 0)
    return _unit(words), _unit(sound)


def rotary(pos: torch.Tensor, pairs: int, scale: float) -> torch.Tensor:
    """RoPE-like features [N, 2*pairs] of positions `pos` [N]: cos/sin at geometric frequencies
    whose slowest period spans ~`scale`*8 and fastest ~`scale`*2, so q.k decays with distance
    over about `scale` positions. Rows with NaN position get zeros (no position)."""
    freqs = (math.pi / scale) / (2.0 ** (torch.arange(pairs, dtype=torch.float32, device=pos.device) * 2 / max(1, pairs - 1)))
    ang = pos.view(-1, 1) * freqs.view(1, -1)
    feats = torch.cat([torch.cos(ang), torch.sin(ang)], dim=1) / math.sqrt(pairs)
    return torch.nan_to_num(feats, nan=0.0) * (~torch.isnan(pos)).view(-1, 1)


@dataclass
class _Tokens:
    pos: torch.Tensor  # [S, 3] (t, y, x); NaN where a token has no such coordinate
    content: torch.Tensor  # [S, C] unit
    is_video: torch.Tensor  # [S] bool
    is_context: torch.Tensor  # [S] bool
    noise: torch.Tensor  # [S, 2, NOISE_DIM] independent q and k noise (k noise reused for v)


def _tokens(size: SceneSize, cuts: int, gen: torch.Generator) -> _Tokens:
    T, H, W = size.grid
    video, objects = video_content(size.grid, cuts, gen)
    words, sound = context_content(size.text, size.audio, objects, gen)
    t, y, x = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    vpos = torch.stack([t, y, x], -1).reshape(-1, 3).float()
    nan = float("nan")
    tpos = torch.full((size.text, 3), nan)
    apos = torch.full((size.audio, 3), nan)
    apos[:, 0] = (torch.arange(size.audio, dtype=torch.float32) + 0.5) * T / max(1, size.audio)
    S = size.total
    is_video = torch.zeros(S, dtype=torch.bool)
    is_video[size.text + size.audio:] = True
    return _Tokens(torch.cat([tpos, apos, vpos]), torch.cat([words, sound, video]), is_video, ~is_video,
                   torch.randn(S, 2, NOISE_DIM, generator=gen))


def size_factors(size: SceneSize) -> tuple[float, float]:
    """How head widths grow with the video: (spatial, temporal) factors relative to `cpu-small`,
    so a head covers a similar share of the video at every size."""
    T, H, W = size.grid
    return math.sqrt(H * W / (16 * 24)), (T / 8) ** TIME_EXP


def context_share(rest: torch.Tensor, axis: torch.Tensor, k: torch.Tensor, context_rows: int, gain: float,
                  target: float) -> float:
    """Share a of the context axis in video queries that puts `target` of their mass on context.

    A query is q(a) = sqrt(1-a) rest + sqrt(a) axis (disjoint dims, so |q(a)|^2 = (1-a)|rest|^2 + a
    for a unit axis), RMS-normalised; its logits against the normalised keys k are
    gain * (sqrt(1-a) rest.k + sqrt(a) axis.k) / |q(a)|. The mean context mass of the given
    query rows grows with a, so bisection finds it (deterministic, 24 steps).
    """
    r, c = rest @ k.T, axis @ k.T
    norm2 = rest.pow(2).sum(-1, keepdim=True)
    lo, hi = 0.0, 0.95
    for _ in range(24):
        a = (lo + hi) / 2
        logits = gain * (math.sqrt(1 - a) * r + math.sqrt(a) * c) / ((1 - a) * norm2 + a).sqrt()
        mass = torch.softmax(logits, -1)[:, :context_rows].sum(-1).mean().item()
        lo, hi = (a, hi) if mass < target else (lo, a)
    return (lo + hi) / 2


def _head(tok: _Tokens, kind: HeadKind, D: int, factors: tuple[float, float], gen: torch.Generator,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [S, D] fp32 of one head (q, k RMS-normalised and scaled by the gain)."""
    jitter = lambda: float(0.9 + 0.2 * torch.rand((), generator=gen))  # noqa: E731 - per-head variation
    f_s, f_t = factors
    pos_d, ctx_d, con_d = 3 * 2 * max(1, D // 16), D // 8, D // 4
    noise_d = D - pos_d - ctx_d - con_d
    pairs = pos_d // 6
    pos = tok.pos
    has_pos = (~torch.isnan(pos)).float()
    parts = [rotary(pos[:, 0], pairs, kind.t_scale * f_t * jitter()),
             rotary(pos[:, 1], pairs, kind.s_scale * f_s * jitter()),
             rotary(pos[:, 2], pairs, kind.s_scale * f_s * jitter())]
    pos_feats = torch.cat(parts, 1) / has_pos.sum(1, keepdim=True).clamp_min(1).sqrt()  # unit (or zero)
    rot = torch.linalg.qr(torch.randn(CONTENT_DIM, CONTENT_DIM, generator=gen))[0][:, :con_d].to(device)
    content = _unit(tok.content @ rot)
    u = _unit(torch.randn(ctx_d, generator=gen)).to(device)
    mix = torch.randn(2, NOISE_DIM, noise_d, generator=gen).to(device)
    noise_q, noise_k = _unit(tok.noise[:, 0] @ mix[0]), _unit(tok.noise[:, 1] @ mix[1])
    is_video = tok.is_video.view(-1, 1).float()
    gain = kind.gain * jitter()
    rest = kind.pos + kind.content + kind.noise
    w_pos, w_con, w_noise = (math.sqrt(x / rest) for x in (kind.pos * jitter(), kind.content * jitter(), kind.noise))
    k_rest = is_video + math.sqrt(1 - CONTEXT_KEY_SHARE) * (1 - is_video)
    k = torch.cat([k_rest * w_pos * pos_feats, k_rest * w_con * content, math.sqrt(CONTEXT_KEY_SHARE) * (1 - is_video) * u,
                   k_rest * w_noise * noise_k], 1)
    k = k / k.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * gain
    q_rest = torch.cat([w_pos * pos_feats, w_con * content, torch.zeros_like(content[:, :ctx_d]), w_noise * noise_q], 1)
    q_axis = torch.cat([torch.zeros_like(pos_feats), torch.zeros_like(content), u.expand(len(content), -1),
                        torch.zeros_like(noise_q)], 1)
    video = torch.nonzero(tok.is_video).flatten()
    probe = video[torch.linspace(0, len(video) - 1, CALIBRATION_ROWS, device=device).long()]
    context_rows = int(video[0])  # context precedes the video in H3's packing
    a = context_share(q_rest[probe], q_axis[probe], k, context_rows, gain, kind.ctx_mass * jitter())
    share = is_video * math.sqrt(a)
    q = torch.sqrt(1 - share.pow(2)) * q_rest + share * q_axis
    q = q / q.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * gain
    v_proj = torch.randn(CONTENT_DIM, D, generator=gen).to(device) / math.sqrt(CONTENT_DIM)
    v_noise = torch.randn(NOISE_DIM, D, generator=gen).to(device) / math.sqrt(NOISE_DIM)
    v = tok.content @ v_proj * 2.0 + tok.noise[:, 1] @ v_noise * 0.5
    return q, k, v


def noised(tok: _Tokens, noise: float, seed: int) -> _Tokens:
    """The tokens at flow sigma `noise`: generated rows' content (1 - s) x_0 + s e (see the module)."""
    if not 0.0 <= noise <= 1.0:
        raise SparseAttentionError(f"make_scene: noise={noise!r} is not allowed: expected a flow sigma in [0, 1]")
    if noise == 0.0:
        return tok
    e = torch.randn(tok.content.shape, generator=torch.Generator().manual_seed(seed)) / math.sqrt(CONTENT_DIM)
    generated = (tok.is_video | ~torch.isnan(tok.pos[:, 0])).view(-1, 1)  # video and audio rows (text has no t)
    content = torch.where(generated, (1.0 - noise) * tok.content + noise * e, tok.content)
    return _Tokens(tok.pos, content, tok.is_video, tok.is_context, tok.noise)


def make_scene(name: str, size: SceneSize | str, seed: int = 0, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, noise: float = 0.0) -> Scene:
    """Generate scene `name` ("pan": one shot with a camera pan; "cuts": three shots; "gaussian":
    i.i.d. N(0, 1) control) at `size` (a SceneSize or a key of SIZES), deterministic per seed;
    `noise`: the flow sigma of a denoising step (0: the clean scene; see the module docstring)."""
    if isinstance(size, str):
        if size not in SIZES:
            raise SparseAttentionError(f"make_scene: size={size!r} is not allowed: expected one of {', '.join(SIZES)}")
        size = SIZES[size]
    if name not in SCENES:
        raise SparseAttentionError(f"make_scene: name={name!r} is not allowed: expected one of {', '.join(SCENES)}")
    if noise != 0.0 and name == "gaussian":
        raise SparseAttentionError(f"make_scene: noise={noise!r} is not allowed for the gaussian control: expected 0")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed * 1000 + SCENES.index(name))
    H, S, D = size.heads, size.total, size.head_dim
    shape = (1, H, S, D)
    q, k, v = (torch.empty(shape, dtype=dtype, device=device) for _ in range(3))
    kinds = tuple(HEAD_KINDS[h % len(HEAD_KINDS)] for h in range(H))
    if name == "gaussian":
        for h in range(H):  # per head, so the peak host memory stays one head's worth
            for t in (q, k, v):
                t[0, h] = torch.randn(S, D, generator=gen).to(device, dtype)
        return Scene(name, seed, q, k, v, size.layout(), ("gaussian",) * H)
    tok = noised(_tokens(size, cuts=0 if name == "pan" else 2, gen=gen), noise, seed * 1000 + SCENES.index(name) + 7919)
    tok = _Tokens(*(getattr(tok, f.name).to(device) for f in fields(_Tokens)))
    factors = size_factors(size)
    for h, kind in enumerate(kinds):
        qh, kh, vh = _head(tok, KIND_WEIGHTS[kind], D, factors, gen, device)
        q[0, h], k[0, h], v[0, h] = qh.to(dtype), kh.to(dtype), vh.to(dtype)
    return Scene(name, seed, q, k, v, size.layout(), kinds)


def h3_qkv(layout: SequenceLayout, heads: int, dim: int, dtype: torch.dtype,
           seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v [1, H, S, D] on CUDA as views of one [1, S, 3, H, D] buffer, the way H3's
    fused projection produces them (for timings, whose cost depends on shapes and strides only).

    Args:
        layout: the sequence; S = layout.total.
        heads, dim: H and D.
        dtype: element type of the buffer.
        seed: seed of the CUDA generator.
    Returns:
        (q, k, v), non-contiguous views with H3's strides.
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    buf = torch.randn(1, layout.total, 3, heads, dim, device="cuda", dtype=dtype, generator=g)
    return tuple(buf[:, :, i].transpose(1, 2) for i in range(3))


def strided_qkv(rows: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v [1, H, S, D] laid out as ComfyUI's H3 attention hands them to the dense kernel:
    strided views of one fused [S, 3 * H * D] projection (so the dense choice's key matches)."""
    g = torch.Generator(device).manual_seed(0)
    qkv = torch.randn(1, rows, 3, heads, head_dim, generator=g, device=device, dtype=dtype)
    return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))
