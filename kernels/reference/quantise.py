"""The 8-bit quantisation of the exact loop (`kernels/eight_bit.py`), in pure torch: the oracle of the
Triton pre-pass (`triton/block_quantise.py`), in fp32 arithmetic of the kernel's order, so the codes
agree bit for bit."""
from __future__ import annotations

import torch

from ...errors import SparseAttentionError
from ..eight_bit import CODE_TOP, FP8_TOP, P_SCALE, PV_FORMATS, V_TOP, QuantisedBlocks, key_mean, value_max
from ..plan import BlockSparsePlan, pack


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
    """The 8-bit Q, K, V of every head (the scheme: `kernels/eight_bit.py`).

    Args:
        q, k, v: [B, H, S, D] in model order (any float dtype; quantised from their fp32 values).
        plan: the plan whose tiling orders the slots.
        pv: "fp8" or "int8", the P.V format (V's codes).
        mean: the key mean [B, H, D] fp32 (default `key_mean(k)`).
    Returns:
        The `QuantisedBlocks` of all H heads.
    """
    if pv not in PV_FORMATS:
        raise SparseAttentionError(f"quantise_blocks: pv={pv!r} is not allowed: expected one of {', '.join(PV_FORMATS)}")
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
