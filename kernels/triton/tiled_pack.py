"""Fused Triton gather of Q, K and V into tiled order, for kernels that read contiguous blocks.

One program per (batch * head, 64 slots; the last one masked where L is no multiple of 64): it
reads the slots' model-order rows from q_perm and k_perm and copies those rows of q, k and v (any
strides) into contiguous [B, H, L, D] tensors, zero in padding slots: one pass over the data, where
`plan.pack` makes one per tensor and a separate fill. Importing this module imports Triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import SparseAttentionError
from ..offsets import perm_strides
from .configs import row_align

SLOTS = 64  # slots per program


@triton.jit
def _copy_rows(X, Y, rows, b, h, bh, slots, sx_b, sx_h, sx_s, sx_d, L, offs_d, ALIGN: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    base = tl.multiple_of(b * sx_b + h * sx_h, ALIGN)
    x = tl.load(X + base + rows.to(tl.int64)[:, None] * sx_s + offs_d[None, :] * sx_d, mask=(rows >= 0)[:, None],
                other=0.0)
    tl.store(Y + (bh * L + slots.to(tl.int64))[:, None] * HEAD_DIM + offs_d[None, :], x, mask=(slots < L)[:, None])


@triton.jit(do_not_specialize=['H', 'L', 'sq_b', 'sq_h', 'sk_b', 'sk_h', 'sv_b', 'sv_h',
                               'sqp_b', 'sqp_h', 'skp_b', 'skp_h'])
def _pack_qkv(Q, K, V, QPerm, KPerm, QT, KT, VT,
              sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, sqp_b, sqp_h, skp_b, skp_h, H, L,
              HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    inside = slots < L
    q_rows = tl.load(QPerm + b * sqp_b + h * sqp_h + slots, mask=inside, other=-1)
    k_rows = tl.load(KPerm + b * skp_b + h * skp_h + slots, mask=inside, other=-1)
    _copy_rows(Q, QT, q_rows, b, h, bh, slots, sq_b, sq_h, sq_s, sq_d, L, offs_d, ALIGN, HEAD_DIM)
    _copy_rows(K, KT, k_rows, b, h, bh, slots, sk_b, sk_h, sk_s, sk_d, L, offs_d, ALIGN, HEAD_DIM)
    _copy_rows(V, VT, k_rows, b, h, bh, slots, sv_b, sv_h, sv_s, sv_d, L, offs_d, ALIGN, HEAD_DIM)


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_perm: torch.Tensor, k_perm: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`plan.pack` of q by q_perm and of k and v by k_perm, in one launch.

    Args:
        q, k, v: [B, H, S, D], one dtype and device, any strides, D a power of two.
        q_perm, k_perm: int32 [Bp, Hp, L] (Bp in (1, B), Hp in (1, H)).
    Returns:
        Contiguous (qt, kt, vt) [B, H, L, D]; padding slots are zero.
    """
    B, H, _, D = q.shape
    L = q_perm.shape[-1]
    if k_perm.shape[-1] != L or D & (D - 1):
        raise SparseAttentionError(f"pack_qkv: expected permutations of one length ({L} slots) and a power-of-two head_dim, "
                         f"got k_perm {tuple(k_perm.shape)}, D={D}")
    qt, kt, vt = (torch.empty(B, H, L, D, dtype=q.dtype, device=q.device) for _ in range(3))
    q_perm, k_perm = q_perm.contiguous(), k_perm.contiguous()
    _pack_qkv[(triton.cdiv(L, SLOTS), B * H)](
        q, k, v, q_perm, k_perm, qt, kt, vt, *q.stride(), *k.stride(), *v.stride(),
        *perm_strides(q_perm), *perm_strides(k_perm), H, L,
        HEAD_DIM=D, BLOCK=SLOTS, ALIGN=row_align(q, k, v), num_warps=4)
    return qt, kt, vt
