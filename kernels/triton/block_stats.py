"""Fused Triton planner kernels: per-block sums and tail summaries, gathered through a tiling.

One program per (batch * head, block). It reads the block's slots of the permutation, gathers
those rows of the input straight from model order (no permuted or upcast copy in memory), and
reduces them in fp32. The block sums feed the block means (routing, coarse tail); the summary
kernel builds a block's tail summary in one pass over its K and V rows:

- with an anchor a: weights softmax(a.k / sqrt(D)) over the block's valid rows with a finite key
  (rows with a non-finite key are left out, their values too);
  key sum w k stored in K's dtype, value sum w v, bias logsumexp - a.key / sqrt(D) against the
  stored (rounded) key (-inf without finite keys), the definition of `backend/tail.reweight_summaries`;
- without: mean key and value (non-finite entries 0) and bias log(n), as `backend/tail.mean_summaries`.

The torch code in `backend/` stays the reference (CPU, float64). Importing this module imports
Triton: `family.py` imports it only when a call resolves to it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import SparseAttentionError
from ..offsets import perm_strides
from .configs import TRITON_DTYPES as DTYPES
from .configs import row_align



@triton.jit
def _block_slots(Perm, BlockLen, b, h, j, sp_b, sp_h, BS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Model-order rows of block j's slots (-1 for padding and for slots past BS) and its length."""
    offs_s = tl.arange(0, BLOCK_S)
    rows = tl.load(Perm + b * sp_b + h * sp_h + j * BS + offs_s, mask=offs_s < BS, other=-1)
    return rows, tl.load(BlockLen + j)


@triton.jit
def _gather_rows(X, rows, b, h, sx_b, sx_h, sx_s, sx_d, offs_d, dmask, ALIGN: tl.constexpr):
    """Rows of x[b, h] as fp32 [BLOCK_S, BLOCK_D]; padding slots and columns past D are zero.

    The (batch, head) strides are not specialised (they change with the clip length), so ALIGN
    (which divides them) tells the compiler the rows stay aligned: vector loads, not one per element."""
    base = tl.multiple_of(b * sx_b + h * sx_h, ALIGN)
    ptr = X + base + rows.to(tl.int64)[:, None] * sx_s + offs_d[None, :] * sx_d
    return tl.load(ptr, mask=(rows >= 0)[:, None] & dmask[None, :], other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=['H', 'J', 'sx_b', 'sx_h', 'sp_b', 'sp_h'])
def _block_sums(X, Perm, BlockLen, Out,
                sx_b, sx_h, sx_s, sx_d, sp_b, sp_h, H, J, D,
                BS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ALIGN: tl.constexpr):
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    rows, _ = _block_slots(Perm, BlockLen, b, h, j, sp_b, sp_h, BS, BLOCK_S)
    x = _gather_rows(X, rows, b, h, sx_b, sx_h, sx_s, sx_d, offs_d, dmask, ALIGN)
    tl.store(Out + (bh.to(tl.int64) * J + j) * D + offs_d, tl.sum(x, 0), mask=dmask)


@triton.jit(do_not_specialize=['H', 'J', 'sk_b', 'sk_h', 'sv_b', 'sv_h', 'sp_b', 'sp_h'])
def _block_summaries(K, V, Perm, BlockLen, Anchor, Key, Value, Bias,
                     sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, sp_b, sp_h, H, J, D, scale,
                     BS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                     ALIGN: tl.constexpr, REWEIGHT: tl.constexpr):
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    row = bh.to(tl.int64) * J + j  # (b, h, j) row of the outputs
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    rows, n = _block_slots(Perm, BlockLen, b, h, j, sp_b, sp_h, BS, BLOCK_S)
    valid = tl.arange(0, BLOCK_S) < n
    kb = _gather_rows(K, rows, b, h, sk_b, sk_h, sk_s, sk_d, offs_d, dmask, ALIGN)
    vb = _gather_rows(V, rows, b, h, sv_b, sv_h, sv_s, sv_d, offs_d, dmask, ALIGN)  # in flight during the key's work
    if REWEIGHT:
        # a non-finite key row is left out: x * 0 is NaN for NaN and +-inf and +-0 otherwise, so a
        # row's sum is 0 exactly when all its entries are finite (the same rows as counting
        # |x| < inf, and cheaper than that integer count); no finite key: no summary
        good = valid & (tl.sum(kb * 0.0, 1) == 0.0)
        kb = tl.where(good[:, None], kb, 0.0)
        a = tl.load(Anchor + bh.to(tl.int64) * D + offs_d, mask=dmask, other=0.0)
        logit = tl.where(good, tl.sum(kb * a[None, :], 1) * scale, float("-inf"))
        m = tl.max(logit, 0)
        p = tl.exp(logit - tl.where(m > float("-inf"), m, 0.0))
        total = tl.sum(p, 0)
        norm = tl.where(total > 0.0, total, 1.0)
        lse = tl.where(total > 0.0, m + tl.log(norm), float("-inf"))
    else:
        p = tl.where(valid, 1.0, 0.0)
        norm = n.to(tl.float32)
    key = tl.div_rn(tl.sum(p[:, None] * kb, 0), norm)
    if not REWEIGHT:  # non-finite means become 0, as `pooling.block_means` makes them
        key = tl.where(tl.abs(key) < float("inf"), key, 0.0)
    key = key.to(Key.dtype.element_ty)
    tl.store(Key + row * D + offs_d, key, mask=dmask)
    if REWEIGHT:
        bias = lse - tl.sum(key.to(tl.float32) * a, 0) * scale
    else:
        bias = tl.log(norm)
    if REWEIGHT:
        vb = tl.where(good[:, None], vb, 0.0)  # the left-out rows' values too (0 * inf would be NaN)
    value = tl.div_rn(tl.sum(p[:, None] * vb, 0), norm)
    if not REWEIGHT:
        value = tl.where(tl.abs(value) < float("inf"), value, 0.0)
    tl.store(Value + row * D + offs_d, value.to(Value.dtype.element_ty), mask=dmask)
    tl.store(Bias + row, bias)


def _check(name: str, x: torch.Tensor, perm: torch.Tensor, block_len: torch.Tensor, block_size: int) -> None:
    if x.dim() != 4:
        raise SparseAttentionError(f"{name}: x must be [B, H, S, D], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise SparseAttentionError(f"{name}: dtype={x.dtype} is not supported: expected one of "
                         f"{', '.join(str(d) for d in DTYPES)}")
    B, H = x.shape[:2]
    J = block_len.numel()
    if (perm.dim() != 3 or perm.shape[0] not in (1, B) or perm.shape[1] not in (1, H)
            or perm.shape[2] != J * block_size or perm.dtype != torch.int32):
        raise SparseAttentionError(f"{name}: perm must be int32 [1 or {B}, 1 or {H}, {J * block_size}] "
                         f"(block_len has {J} blocks of {block_size}), got {perm.dtype} {tuple(perm.shape)}")


def _launch_args(head_dim: int, block_size: int, *tensors: torch.Tensor) -> dict:
    block_s, block_d = triton.next_power_of_2(block_size), triton.next_power_of_2(head_dim)
    # one fp32 [rows, D] tile per tensor, 128 values per thread: few warps keep a 64 x 128 gather
    # at full bandwidth, more only add scheduling cost
    return dict(BS=block_size, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=max(1, block_s * block_d // 4096),
                ALIGN=row_align(*tensors))


def block_sums_triton(x: torch.Tensor, perm: torch.Tensor, block_len: torch.Tensor, block_size: int
                      ) -> torch.Tensor:
    """fp32 [B, H, J, D] sums of every block's rows of x [B, H, S, D] (perm [Bp, Hp, J*block_size]
    int32 slot -> row, -1 padding; padding slots add nothing)."""
    _check("block_sums_triton", x, perm, block_len, block_size)
    B, H, _, D = x.shape
    J = block_len.numel()
    perm = perm.contiguous()
    out = torch.empty(B, H, J, D, dtype=torch.float32, device=x.device)
    _block_sums[(J, B * H)](x, perm, block_len.contiguous(), out, *x.stride(), *perm_strides(perm),
                            H, J, D, **_launch_args(D, block_size, x))
    return out


def block_summaries_triton(k: torch.Tensor, v: torch.Tensor, perm: torch.Tensor, block_len: torch.Tensor,
                           block_size: int, anchor: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tail summaries of every key block: (key [B,H,J,D] k.dtype, value [B,H,J,D] v.dtype, bias
    [B,H,J] fp32). With `anchor` [B, H, D] the anchor-reweighted summary, without it the mean one.
    One pass over the block's K and V rows; the first block_len[j] slots of a block are its rows."""
    _check("block_summaries_triton", k, perm, block_len, block_size)
    _check("block_summaries_triton", v, perm, block_len, block_size)
    if v.shape != k.shape:
        raise SparseAttentionError(f"block_summaries_triton: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    B, H, _, D = k.shape
    J = block_len.numel()
    if anchor is not None and anchor.shape != (B, H, D):
        raise SparseAttentionError(f"block_summaries_triton: anchor must be [B, H, D] = {(B, H, D)}, got {tuple(anchor.shape)}")
    perm = perm.contiguous()
    key = k.new_empty(B, H, J, D)
    value = v.new_empty(B, H, J, D)
    bias = torch.empty(B, H, J, dtype=torch.float32, device=k.device)
    a = key if anchor is None else anchor.to(torch.float32).contiguous()  # unread without an anchor
    _block_summaries[(J, B * H)](k, v, perm, block_len.contiguous(), a, key, value, bias,
                                 *k.stride(), *v.stride(), *perm_strides(perm), H, J, D, D ** -0.5,
                                 REWEIGHT=anchor is not None, **_launch_args(D, block_size, k, v))
    return key, value, bias
