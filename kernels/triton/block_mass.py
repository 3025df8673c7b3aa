"""Triton kernel of the per-head tiling choice (`backend/head_choice.py`): block log-masses.

For a few probe queries per head and one tiling's key permutation, the natural log of every key
block's exact softmax numerator, log sum_i exp(q . k_i / sqrt(D)) over the block's rows. One
program per (run of blocks, head) keeps the head's probes in registers, gathers each block's key
rows by index (no permuted copy of K) and reduces their probe logits on tensor cores to one
value per (probe, block). The torch path would hold the [heads, probes, keys] logits (a
gigabyte per tiling at long clips); this writes only [heads, probes, blocks].

Top share: per row of log-masses, the share of the row's mass in its `budget` heaviest blocks,
one program per row with a radix select (`radix_select.top_k_mask_pair`), in place of torch's
TopK, log-sum-exp and exponentials of the same [3, heads, probes, blocks] tensor (each a pass
over it).

Importing this module imports Triton: `family.py` imports it only when a call resolves to it.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...errors import SparseAttentionError
from .configs import dot_precision, row_align
from .radix_select import row_split, top_k_mask_pair

BLOCKS = 4  # key blocks per program: the probes are loaded once for all of them


@triton.jit(do_not_specialize=['n_blocks', 'sk_g'])
def _block_log_mass(Q, K, Perm, Out, n_blocks, D, scale, sq_g, sq_p, sk_g, sk_s, sp_g, P: tl.constexpr,
                    DP: tl.constexpr, BS: tl.constexpr, BLOCKS: tl.constexpr, PRECISION: tl.constexpr,
                    ALIGN: tl.constexpr):
    g = tl.program_id(1).to(tl.int64)
    p = tl.arange(0, P)
    d = tl.arange(0, DP)
    r = tl.arange(0, BS)
    dmask = d < D
    q = tl.load(Q + g * sq_g + p[:, None] * sq_p + d[None, :], mask=dmask[None, :], other=0.0)
    for t in tl.static_range(BLOCKS):
        j = tl.program_id(0) * BLOCKS + t
        ids = tl.load(Perm + g * sp_g + j * BS + r, mask=j < n_blocks, other=-1)
        live = ids >= 0
        # ALIGN divides the unspecialised head stride and the row stride (`configs.row_align`): vector loads
        krow = tl.multiple_of(g * sk_g + ids.to(tl.int64) * sk_s, ALIGN)
        k = tl.load(K + krow[:, None] + d[None, :], mask=live[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # log2 units
        s = tl.where(live[None, :], s, float("-inf"))
        m = tl.max(s, 1)
        m = tl.where(m > float("-inf"), m, 0.0)  # an empty block: log2(0) = -inf below
        total = tl.sum(tl.exp2(s - m[:, None]), 1)
        tl.store(Out + (g * P + p) * n_blocks + j, (m + tl.log2(total)) * 0.6931471805599453,
                 mask=j < n_blocks)


@triton.jit(do_not_specialize=['n', 'budget'])
def _top_share(LogMass, Out, n, budget, HEAD: tl.constexpr, TAIL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HEAD)
    live = offs < n
    x = tl.load(LogMass + row * n + offs, mask=live, other=float("-inf"))
    tail = HEAD + tl.arange(0, TAIL)  # lanes HEAD.. of the row in a short second vector (radix_select.row_split)
    live_t = tail < n
    y = tl.load(LogMass + row * n + tail, mask=live_t, other=float("-inf"))
    pick, pick_t = top_k_mask_pair(x, live, y, live_t, budget)
    m = tl.maximum(tl.max(x, 0), tl.max(y, 0))
    w, w_t = tl.exp(x - m), tl.exp(y - m)  # 0 on padding
    top = tl.sum(tl.where(pick, w, 0.0), 0) + tl.sum(tl.where(pick_t, w_t, 0.0), 0)
    total = tl.sum(w, 0) + tl.sum(w_t, 0)
    tl.store(Out + row, top / total)


def block_log_mass_triton(probes: torch.Tensor, k: torch.Tensor, perm: torch.Tensor, block_size: int) -> torch.Tensor:
    """Log-masses [G, P, n] (fp32, natural log) of probes [G, P, D] over the n = perm.shape[-1] /
    block_size key blocks of k [G, S, D] listed by perm [Gp, n * block_size] (Gp in {1, G}; int32
    rows of k, -1 for padding). P and block_size are powers of two (at least 16); k and the
    probes share a 16-bit or fp32 dtype and may have any row and head strides."""
    G, P, D = probes.shape
    n = perm.shape[-1] // block_size
    if k.dtype != probes.dtype or k.shape[0] != G or k.shape[-1] != D:
        raise SparseAttentionError(f"block_log_mass_triton: k must be [G={G}, S, D={D}] in {probes.dtype}, got "
                         f"{tuple(k.shape)} {k.dtype}")
    for name, size in (("probes", P), ("block_size", block_size)):
        if size < 16 or size & (size - 1):
            raise SparseAttentionError(f"block_log_mass_triton: {name}={size} is not allowed: expected a power of two >= 16")
    if perm.dtype != torch.int32 or perm.shape[0] not in (1, G) or perm.stride(-1) != 1:
        raise SparseAttentionError(f"block_log_mass_triton: perm must be int32 [1 or {G}, n * block_size] with unit last "
                         f"stride, got {perm.dtype} {tuple(perm.shape)}")
    if probes.stride(-1) != 1:
        probes = probes.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    out = torch.empty(G, P, n, dtype=torch.float32, device=k.device)
    grid = (triton.cdiv(n, BLOCKS), G)
    _block_log_mass[grid](probes, k, perm, out, n, D, D ** -0.5 * math.log2(math.e), probes.stride(0),
                          probes.stride(1), k.stride(0), k.stride(1), perm.stride(0) if perm.shape[0] > 1 else 0,
                          P=P, DP=max(16, triton.next_power_of_2(D)), BS=block_size, BLOCKS=BLOCKS,
                          PRECISION=dot_precision(k.dtype), ALIGN=row_align(k), num_warps=4)
    return out


def top_share_triton(log_mass: torch.Tensor, budget: int) -> torch.Tensor:
    """Share of every row's mass in its `budget` heaviest entries: fp32 log-masses [..., n] ->
    [...] (sum of exp over the top `budget` / sum of exp over the row)."""
    n = log_mass.shape[-1]
    if log_mass.dtype != torch.float32:
        raise SparseAttentionError(f"top_share_triton: log_mass.dtype={log_mass.dtype} is not allowed: expected float32")
    if not 1 <= budget <= n:
        raise SparseAttentionError(f"top_share_triton: budget={budget} is not allowed: expected 1 <= budget <= {n} (the row length)")
    rows = log_mass.contiguous().view(-1, n)
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=log_mass.device)
    head, tail = row_split(n)
    _top_share[(rows.shape[0],)](rows, out, n, budget, HEAD=head, TAIL=tail, num_warps=max(1, min(8, head // 1024)))
    return out.view(log_mass.shape[:-1])
