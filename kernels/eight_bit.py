"""8-bit arithmetic of the exact loop over the selected key blocks: the quantisation, in pure torch.

This is the oracle of the Triton pre-pass (`block_quantise`) and of the 8-bit loop of the fused
kernel (`triton_attention`); `reference.block_sparse_reference(eight_bit=...)` computes attention
from these codes. Every step is fp32 arithmetic in the kernel's order, so the codes agree bit for bit.

Per call, in tiled order (`plan.pack`), per (batch, head):
- K is smoothed: the head's key mean over its rows (fp32) is subtracted from every key. That shifts
  the logits of a query row by one constant, q . mean, which the kernel adds back (`q_shift`), so
  the exact keys, the dense prefix and the summaries still share one softmax.
- Q and smoothed K are rotated by the same Hadamard matrix (unnormalised: +-1 entries, applied by
  log2(D) butterflies of exact-order fp32 adds), which leaves q . k times D and spreads an outlier
  channel over all channels; then INT8 codes, one scale per block (its largest magnitude / 127,
  Q's also / D), rounded half away from zero.
- V: one scale per channel of the head (its largest magnitude over the head's rows), so the scales
  leave the loop: FP8 e4m3 codes (magnitude up to 448) or INT8 codes (up to 127). Stored transposed
  [D, L] so that P.V reads V along its reduction dimension, as 8-bit MMA wants.
- P (in the kernel, per key tile of block_n rows, `triton_attention._quantised_keys`): FP8 codes of
  256 exp2(s - ref), ref the running max of the picks' tile maxima (floating codes keep their
  relative precision however small p gets); INT8 codes round(127 exp2(s - the tile's own max))
  (unsigned values on a uniform grid, which needs the tile's own range; Triton's tl.dot takes one
  dtype for both operands, so no u8 x s8), their product weighted by exp2(tile max - ref). The
  sums of p and the accumulation across tiles are fp32, outside the MMA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import BlockSparsePlan, pack

CODE_TOP = 127.0  # INT8 codes of Q, K (and V on the int8 path)
FP8_TOP = 448.0  # largest e4m3 magnitude
P_SCALE = {"fp8": 256.0, "int8": 127.0}  # p' in (0, 1] -> codes
V_TOP = {"fp8": FP8_TOP, "int8": CODE_TOP}
PV_FORMATS = tuple(P_SCALE)
PRECISIONS = ("bf16", "8-bit")  # what the kernels take: bf16 is the inputs' own precision


@dataclass(frozen=True)
class QuantisedBlocks:
    """Q, K, V of some heads in 8 bits, tiled order (L = J * block_size slots, zero in padding).

    q_codes, k_codes: int8 [B, h, L, D] (rotated); q_scale, k_scale: fp32 [B, h, J]; q_shift: fp32 [B, h, L],
    q . key mean of every query slot; v_codes: int8 or float8_e4m3fn [B, h, D, L] (transposed);
    v_scale: fp32 [B, h, J, D]."""

    q_codes: torch.Tensor
    q_scale: torch.Tensor
    q_shift: torch.Tensor
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor


def key_mean(k: torch.Tensor) -> torch.Tensor:
    """fp32 [B, H, D]: the mean key of every (batch, head) over its S rows (the smoothing of K)."""
    return k.mean(2, dtype=torch.float32)


def hadamard_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the unnormalised Sylvester-Hadamard matrix (D a power of two), by the
    butterflies of `block_quantise.hadamard_rows` in the same order (so the same fp32 bits)."""
    D, h = x.shape[-1], 1
    while h < D:
        pairs = x.unflatten(-1, (D // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], -2).flatten(-3)
        h *= 2
    return x


def value_max(v: torch.Tensor) -> torch.Tensor:
    """fp32 [B, H, D]: V's largest magnitude per channel of every (batch, head) (V's scales)."""
    return torch.maximum(v.amax(2), -v.amin(2)).float()


def round_int8(x: torch.Tensor) -> torch.Tensor:
    """fp32 x with |x| <= 127.5 to int8, rounded half away from zero (the kernel's rounding)."""
    return (x + torch.where(x >= 0, 0.5, -0.5)).trunc().to(torch.int8)


def _div(a: torch.Tensor | float, b: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """a / b as one IEEE fp32 division per element, as the kernel divides (torch turns a Python number
    over a tensor into a reciprocal and a multiply, which can differ in the last bit)."""
    return torch.div(torch.as_tensor(a, dtype=torch.float32, device=like.device),
                     torch.as_tensor(b, dtype=torch.float32, device=like.device))


def _blockwise_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 codes [B, H, J, bs, D] and fp32 scales [B, H, J] of x [B, H, J, bs, D], one scale a block."""
    amax = x.abs().amax((-2, -1))
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))  # a zero block keeps zero codes
    return round_int8(x * _div(CODE_TOP, safe, x)[..., None, None]), _div(safe, CODE_TOP, x)


def quantise_p(p: torch.Tensor, pv: str) -> torch.Tensor:
    """The codes of p' in [0, 1] (fp32) as fp32 values: e4m3 of 256 p' (ties to even) or round(127 p')."""
    if pv == "fp8":
        return (p * P_SCALE["fp8"]).to(torch.float8_e4m3fn).float()
    return (p * P_SCALE["int8"] + 0.5).trunc()


def quantise_blocks_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan, pv: str,
                          mean: torch.Tensor | None = None) -> QuantisedBlocks:
    """The 8-bit Q, K, V of every head (see the module).

    Args:
        q, k, v: [B, H, S, D] in model order (any float dtype; quantised from their fp32 values).
        plan: the plan whose tiling orders the slots.
        pv: "fp8" or "int8", the P.V format (V's codes).
        mean: the key mean [B, H, D] fp32 (default `key_mean(k)`).
    Returns:
        The `QuantisedBlocks` of all H heads.
    """
    if pv not in PV_FORMATS:
        raise ValueError(f"quantise_blocks: pv={pv!r} is not allowed: expected one of {', '.join(PV_FORMATS)}")
    B, H, S, D = q.shape
    J, bs = plan.num_blocks, plan.block_size
    mean = key_mean(k) if mean is None else mean
    qt = pack(q, plan.q_perm).float()
    kt = pack(k, plan.k_perm).float()
    vt = pack(v, plan.k_perm).float()
    key_slot = (plan.k_perm >= 0).expand(B, H, -1).unsqueeze(-1)
    kd = torch.where(key_slot, kt - mean.unsqueeze(2), 0.0)  # padding slots stay zero
    q_codes, q_scale = _blockwise_int8(hadamard_rows(qt).view(B, H, J, bs, D))
    k_codes, k_scale = _blockwise_int8(hadamard_rows(kd).view(B, H, J, bs, D))
    q_scale = q_scale * (1.0 / D)  # the rotation multiplies dot products by D (exact: a power of two)
    q_shift = (qt * mean.unsqueeze(2)).sum(-1)
    amax = value_max(v)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    unit = vt * _div(V_TOP[pv], safe, vt).unsqueeze(-2)
    codes = unit.clamp(-FP8_TOP, FP8_TOP).to(torch.float8_e4m3fn) if pv == "fp8" else round_int8(unit)
    return QuantisedBlocks(q_codes.view(B, H, J * bs, D), q_scale, q_shift, k_codes.view(B, H, J * bs, D), k_scale,
                           codes.transpose(-1, -2).contiguous(), _div(safe, V_TOP[pv], vt))
