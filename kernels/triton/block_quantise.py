"""Triton pre-pass of the 8-bit exact loop: Q, K, V of some heads gathered into tiled order and quantised.

One program per (key/query block, batch * head): it reads the block's model-order rows through
q_perm and k_perm (any strides), and writes the block's INT8 codes of Q and of K smoothed by the
head's key mean, both rotated by a Hadamard matrix, their per-block scales, q . mean per query
slot, and V's codes (FP8 e4m3 or INT8, the head's per-channel scales) transposed. The same
arithmetic as `reference/quantise.quantise_blocks_torch` in the same order, so the codes agree bit for bit
(in the CPU interpreter; on the GPU Triton may fuse a multiply-add, which can move a code that sits
on a rounding boundary by one).

The interpreter's own fp32 -> fp8 conversion rounds ties up and truncates subnormals;
`e4m3_grid` (interpreter only) rounds to the e4m3 grid first, ties to even, as the GPU's
conversion does, so the conversion that follows is exact. Importing this module imports Triton.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...errors import SparseAttentionError
from ..eight_bit import PV_FORMATS, QuantisedBlocks
from ..offsets import perm_strides
from .configs import row_align


@triton.jit
def e4m3_grid(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic."""
    a = tl.abs(x)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)  # below 2**-6: e4m3's subnormal step
    ulp = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2 ** (e - 3): three mantissa bits
    inv = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2 ** (3 - e)
    r = (a * inv + 8388608.0) - 8388608.0  # ties to even (a * inv < 16, exact)
    sign = x.to(tl.int32, bitcast=True) & -2147483648  # x's sign bit, also on a zero result (-0 as torch)
    return ((r * ulp).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def hadamard_rows(x, ROWS: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    """Rows of x [ROWS, D] times the (unnormalised, +-1) Sylvester-Hadamard matrix, by log2(D)
    butterflies (a + b, a - b at distance 1, 2, 4, ...), as `reference/quantise.hadamard_rows`."""
    for stage in tl.static_range(LOG_D):  # pairs at distance 2 ** stage
        pairs = tl.permute(tl.reshape(x, [ROWS, D >> (stage + 1), 2, 1 << stage]), (0, 1, 3, 2))
        a, b = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [ROWS, D])
    return x


@triton.jit
def _int8_block(x, TOP: tl.constexpr):
    """INT8 codes of fp32 x (one scale for the whole block) and the scale."""
    amax = tl.max(tl.max(tl.abs(x), 1), 0)
    safe = tl.where(amax > 0, amax, 1.0)
    inv = TOP / safe
    y = x * inv
    return (y + tl.where(y >= 0, 0.5, -0.5)).to(tl.int8), safe / TOP


@triton.jit
def _load_rows(X, rows, b, h, sx_b, sx_h, sx_s, sx_d, offs_d, ALIGN: tl.constexpr):
    base = tl.multiple_of(b * sx_b + h * sx_h, ALIGN)  # rows start on a vector boundary (`configs.row_align`)
    return tl.load(X + base + rows.to(tl.int64)[:, None] * sx_s + offs_d[None, :] * sx_d,
                   mask=(rows >= 0)[:, None], other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=['H', 'H0', 'HC', 'J', 'sq_b', 'sq_h', 'sk_b', 'sk_h', 'sv_b', 'sv_h',
                               'sqp_b', 'sqp_h', 'skp_b', 'skp_h'])
def _quantise_blocks(Q, K, V, QPerm, KPerm, Mean, VMax, QC, QS, QShift, KC, KS, VC, VS,
                     sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
                     sqp_b, sqp_h, skp_b, skp_h, H, H0, HC, J,
                     BS: tl.constexpr, HEAD_DIM: tl.constexpr, LOG_D: tl.constexpr, PV_FP8: tl.constexpr,
                     EMULATE_FP8: tl.constexpr, ALIGN: tl.constexpr):
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # (batch, head among this call's HC heads)
    b = bh // HC
    h = H0 + bh % HC
    L = J * BS
    slots = i * BS + tl.arange(0, BS)
    offs_d = tl.arange(0, HEAD_DIM)
    out = bh * L + slots  # this (batch, head)'s slots of the tiled outputs
    mean = tl.load(Mean + (b * H + h) * HEAD_DIM + offs_d)

    q_rows = tl.load(QPerm + b * sqp_b + h * sqp_h + slots)
    q = _load_rows(Q, q_rows, b, h, sq_b, sq_h, sq_s, sq_d, offs_d, ALIGN)
    tl.store(QShift + out, tl.sum(q * mean[None, :], 1))
    codes, scale = _int8_block(hadamard_rows(q, BS, HEAD_DIM, LOG_D), 127.0)  # eight_bit.CODE_TOP
    tl.store(QC + out[:, None] * HEAD_DIM + offs_d[None, :], codes)
    tl.store(QS + bh * J + i, scale * (1.0 / HEAD_DIM))  # the rotation multiplies dot products by D

    k_rows = tl.load(KPerm + b * skp_b + h * skp_h + slots)
    k = _load_rows(K, k_rows, b, h, sk_b, sk_h, sk_s, sk_d, offs_d, ALIGN)
    k = hadamard_rows(tl.where((k_rows >= 0)[:, None], k - mean[None, :], 0.0), BS, HEAD_DIM, LOG_D)
    codes, scale = _int8_block(k, 127.0)
    tl.store(KC + out[:, None] * HEAD_DIM + offs_d[None, :], codes)
    tl.store(KS + bh * J + i, scale)

    v = _load_rows(V, k_rows, b, h, sv_b, sv_h, sv_s, sv_d, offs_d, ALIGN)
    amax = tl.load(VMax + (b * H + h) * HEAD_DIM + offs_d)  # the head's, per channel
    safe = tl.where(amax > 0, amax, 1.0)
    vt = (bh * HEAD_DIM + offs_d)[None, :] * L + slots[:, None]  # transposed: [D, L]
    if PV_FP8:
        unit = tl.minimum(tl.maximum(v * (448.0 / safe)[None, :], -448.0), 448.0)  # eight_bit.FP8_TOP
        if EMULATE_FP8:
            unit = e4m3_grid(unit)
        tl.store(VC + vt, unit.to(tl.float8e4nv))
        tl.store(VS + bh * HEAD_DIM + offs_d, safe / 448.0)  # every block stores the same
    else:
        unit = v * (127.0 / safe)[None, :]
        tl.store(VC + vt, (unit + tl.where(unit >= 0, 0.5, -0.5)).to(tl.int8))
        tl.store(VS + bh * HEAD_DIM + offs_d, safe / 127.0)


def quantise_blocks_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_perm: torch.Tensor,
                           k_perm: torch.Tensor, mean: torch.Tensor, v_max: torch.Tensor, block_size: int, h0: int,
                           h1: int, pv: str) -> QuantisedBlocks:
    """`reference/quantise.quantise_blocks_torch` of heads [h0, h1) in one launch.

    Args:
        q, k, v: [B, H, S, D] model order, one float dtype, any strides, D a power of two.
        q_perm, k_perm: int32 [Bp, Hp, L] (all H heads, or one shared), L a multiple of block_size.
        mean: fp32 [B, H, D], the key mean (`eight_bit.key_mean`).
        v_max: fp32 [B, H, D], V's largest magnitude per channel (`eight_bit.value_max`).
        block_size: the plan's block size (a power of two).
        h0, h1: the heads to quantise.
        pv: "fp8" or "int8".
    Returns:
        The `QuantisedBlocks` of heads h0:h1 ([B, h1 - h0, ...]).
    """
    if pv not in PV_FORMATS:
        raise SparseAttentionError(f"quantise_blocks_triton: pv={pv!r} is not allowed: expected one of {', '.join(PV_FORMATS)}")
    B, H, _, D = q.shape
    L, hc = q_perm.shape[-1], h1 - h0
    J = L // block_size
    dev = q.device
    qc = torch.empty(B, hc, L, D, dtype=torch.int8, device=dev)
    kc = torch.empty_like(qc)
    vc = torch.empty(B, hc, D, L, dtype=torch.float8_e4m3fn if pv == "fp8" else torch.int8, device=dev)
    qs, ks = (torch.empty(B, hc, J, dtype=torch.float32, device=dev) for _ in range(2))
    shift = torch.empty(B, hc, L, dtype=torch.float32, device=dev)
    vs = torch.empty(B, hc, D, dtype=torch.float32, device=dev)
    q_perm, k_perm = q_perm.contiguous(), k_perm.contiguous()
    _quantise_blocks[(J, B * hc)](
        q, k, v, q_perm, k_perm, mean.contiguous(), v_max.contiguous(), qc, qs, shift, kc, ks, vc, vs,
        *q.stride(), *k.stride(), *v.stride(), *perm_strides(q_perm), *perm_strides(k_perm), H, h0, hc, J,
        BS=block_size, HEAD_DIM=D, LOG_D=D.bit_length() - 1, PV_FP8=pv == "fp8",
        EMULATE_FP8=os.environ.get("TRITON_INTERPRET") == "1",
        ALIGN=row_align(q, k, v),
        num_warps=8 if block_size * D >= 128 * 128 else 4)
    return QuantisedBlocks(qc, qs, shift, kc, ks, vc, vs)
