"""Fused Triton forward kernel of block-sparse attention with tail summaries.

One program per (batch * head, query tile of a query block). It walks the key list of its query
block (the dense prefix [0, dense_hi) followed by the selected blocks q2k_idx[:q2k_num]) in tiles
of `block_n` rows of one key block (the list runs one tile ahead), masks keys beyond each block's
true length, and keeps an online softmax in base 2 with the scale folded in. The exact keys are
read in one of two modes:
- tiled (the default): Q, K and V are first packed into tiled order
  (`tiled_pack.pack_qkv`, contiguous [B, h, J * block_size, D], zero in padding slots),
  HEADS_PER_CALL heads at a time to bound the extra memory, and the kernel runs once per head
  chunk. Its query tile and every K/V tile are then contiguous rows (block * block_size + offset)
  with no per-row index load or mask: 16-byte vector loads that Triton's software pipeliner
  issues `num_stages` tiles ahead (cp.async), as in a dense kernel;
- gather (`tiled=False`): query rows are gathered through `q_perm` and K/V rows through `k_perm`
  row by row (index loads one tile ahead), with no packed copy.
The summaries of unselected candidate blocks join the same softmax: per query (`QuerySummaries`,
selected columns masked by walking the query block's ascending pick list alongside the columns, so
no J x J structure is built) or once per query block (`BlockSummaries`). Rows are normalised once
and stored straight to their model-order rows through `q_perm` (scatter on store, both modes). The
`partial` mode (exact keys from another kernel, `cudnn_attention`) adds only the tail and packs
nothing. Same semantics as `reference.block_sparse_reference`.

Importing this module imports Triton: `kernels/__init__` imports it only on demand.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...errors import SparseAttentionError
from ..arch import EightBitConfig, KernelConfig, eight_bit_config, kernel_config
from ..eight_bit import PRECISIONS, QuantisedBlocks, key_mean, value_max
from ..offsets import perm_strides, wide_rows
from ..plan import EMPTY_ROW_LSE, BlockSparsePlan, BlockSummaries, QuerySummaries, perm_heads
from .block_quantise import e4m3_grid, quantise_blocks_triton
from .configs import TRITON_DTYPES as DTYPES
from .configs import dot_precision, finish_config
from .tiled_pack import pack_qkv

HEADS_PER_CALL = 8  # tiled mode: packed Q/K/V copies stay at most 8 / H of Q/K/V's size


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, scale, vals, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one tile of logits s [M, N] (base 2 once multiplied by `scale`, which is folded into
    the row max and one multiply-add per logit) and their values [N, D] into (acc, m, l)."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    p = tl.exp2(s * scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(DOT_DTYPE), vals, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _list_block(slot, dh, n_slots, SelRow):
    """Key block at position `slot` of a query block's list: the dense prefix, then its picks
    (0, a harmless index, past the end of the list)."""
    picked = tl.load(SelRow + (slot - dh), mask=(slot >= dh) & (slot < n_slots), other=0).to(tl.int32)
    return tl.where(slot < dh, slot, picked)  # int32 whatever the table's width: blk * BS must not wrap


@triton.jit
def _tiled_keys(acc, m_i, l_i, q, K, V, BlockLen, sel_row, dh, n_slots, qk_scale, offs_d,
                BS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                PRECISION: tl.constexpr, ROW_DTYPE: tl.constexpr):
    """Fold the exact keys of one query block's list into (acc, m, l), reading every K/V tile as
    contiguous rows of the packed K, V of one (batch, head) (padding rows are zero and masked).
    The list runs one tile ahead (the block of tile t+1 and its length), so a tile's address is
    known from the previous step: Triton pipelines these loads."""
    SUB: tl.constexpr = BS // BLOCK_N  # key tiles per key block
    offs_n = tl.arange(0, BLOCK_N)
    n_tiles = n_slots * SUB
    blk = _list_block(0, dh, n_slots, sel_row)
    blen = tl.load(BlockLen + blk, mask=n_tiles > 0, other=0)
    for t in range(0, n_tiles):
        first = (t % SUB) * BLOCK_N  # the tile's first row in its block
        kslot = tl.max_contiguous(tl.multiple_of(blk * BS + first + offs_n, BLOCK_N), BLOCK_N)
        koff = kslot.to(ROW_DTYPE) * HEAD_DIM
        kt = tl.load(K + koff[None, :] + offs_d[:, None])
        vt = tl.load(V + koff[:, None] + offs_d[None, :])
        valid = first + offs_n < blen  # keys beyond the block's true length
        s = tl.where(valid[None, :], tl.dot(q, kt.to(DOT_DTYPE), input_precision=PRECISION), float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, qk_scale, vt.to(DOT_DTYPE), DOT_DTYPE, PRECISION)
        blk = _list_block((t + 1) // SUB, dh, n_slots, sel_row)
        blen = tl.load(BlockLen + blk, mask=t + 1 < n_tiles, other=0)
    return acc, m_i, l_i


@triton.jit
def _gathered_keys(acc, m_i, l_i, q, K, V, KPerm, BlockLen, sel_row, dh, n_slots, qk_scale,
                   sk_s, sk_d, sv_s, sv_d, offs_d, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ROW_DTYPE: tl.constexpr):
    """Fold the exact keys of one query block's list into (acc, m, l), gathering K/V rows of one
    (batch, head) through its k_perm row KPerm. Index loads run one tile ahead (block of tile t+1,
    its rows and length, with the block of tile t+2), so that the K/V gathers of a tile depend
    only on values already in registers."""
    SUB: tl.constexpr = BS // BLOCK_N  # key tiles per key block
    offs_n = tl.arange(0, BLOCK_N)
    n_tiles = n_slots * SUB
    blk = _list_block(0, dh, n_slots, sel_row)
    krow = tl.load(KPerm + blk * BS + offs_n, mask=n_tiles > 0, other=-1)
    blen = tl.load(BlockLen + blk, mask=n_tiles > 0, other=0)
    blk_next = _list_block(1 // SUB, dh, n_slots, sel_row)
    for t in range(0, n_tiles):
        r_next = ((t + 1) % SUB) * BLOCK_N + offs_n
        live = t + 1 < n_tiles
        krow_next = tl.load(KPerm + blk_next * BS + r_next, mask=live, other=-1)
        blen_next = tl.load(BlockLen + blk_next, mask=live, other=0)
        blk_after = _list_block((t + 2) // SUB, dh, n_slots, sel_row)

        kmask = krow >= 0
        koff = krow.to(ROW_DTYPE)
        kt = tl.load(K + koff[None, :] * sk_s + offs_d[:, None] * sk_d, mask=kmask[None, :], other=0.0)
        vt = tl.load(V + koff[:, None] * sv_s + offs_d[None, :] * sv_d, mask=kmask[:, None], other=0.0)
        valid = (t % SUB) * BLOCK_N + offs_n < blen  # keys beyond the block's true length
        s = tl.where(valid[None, :], tl.dot(q, kt.to(DOT_DTYPE), input_precision=PRECISION), float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, qk_scale, vt.to(DOT_DTYPE), DOT_DTYPE, PRECISION)
        krow, blen, blk_next = krow_next, blen_next, blk_after
    return acc, m_i, l_i


@triton.jit
def _quantised_keys(acc, m_i, l_i, QC, QS, QShift, KC, KS, VC, VS, BlockLen, sel_row, n_pick, bh, i, J, offs_m,
                    offs_d, qk_scale, BS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                    PV_FP8: tl.constexpr, EMULATE_FP8: tl.constexpr):
    """Fold the selected key blocks of one query block into (acc, m, l) in 8 bits (`eight_bit`).

    Logits: INT8 Q.K^T (exact int32 sums) times the blocks' scales. The loop keeps its own softmax
    state, which depends on these logits only (so the reference reproduces P's codes): `ref`, the
    running max of the tiles' row maxima; the sum of p; and `part`, P's codes times V's codes summed
    in code units, rescaled by exp2(old ref - new ref) when ref grows (fp32, outside the MMA: long
    rows cannot drift). FP8: p = 256 exp2(s - ref) in e4m3. INT8: p = exp2(s - the tile's own max)
    as codes 0..127 (a uniform grid needs the tile's range), their product scaled by exp2(tile max -
    ref). At the end q . key mean (undoing the smoothing) and V's per-channel scales join the part
    to (acc, m, l) as one softmax. Codes are in tiled order (V transposed), (batch, head) `bh`; the
    pick list runs one tile ahead as in `_tiled_keys`."""
    SUB: tl.constexpr = BS // BLOCK_N
    L = J * BS
    offs_n = tl.arange(0, BLOCK_N)
    qslot = i * BS + offs_m
    q = tl.load(QC + (bh * L + qslot)[:, None] * HEAD_DIM + offs_d[None, :])
    q_scale = tl.load(QS + bh * J + i) * qk_scale
    KC += bh * L * HEAD_DIM
    VC += bh * HEAD_DIM * L
    ref = tl.zeros_like(m_i) - 1.0e30  # finite: exp2(ref - ref_new) stays defined
    l8 = tl.zeros_like(l_i)
    part = tl.zeros_like(acc)
    n_tiles = n_pick * SUB
    blk = tl.load(sel_row, mask=n_tiles > 0, other=0).to(tl.int32)
    blen = tl.load(BlockLen + blk, mask=n_tiles > 0, other=0)
    k_scale = tl.load(KS + bh * J + blk, mask=n_tiles > 0, other=0.0)
    for t in range(0, n_tiles):
        first = (t % SUB) * BLOCK_N
        kslot = tl.max_contiguous(tl.multiple_of(blk * BS + first + offs_n, BLOCK_N), BLOCK_N)
        kt = tl.load(KC + kslot[None, :] * HEAD_DIM + offs_d[:, None])
        vt = tl.load(VC + offs_d[None, :] * L + kslot[:, None])
        scale = q_scale * k_scale
        s = tl.where((first + offs_n < blen)[None, :], tl.dot(q, kt, out_dtype=tl.int32).to(tl.float32), float("-inf"))
        top = tl.max(s, 1) * scale  # -inf for a tile past its block's length
        ref_new = tl.maximum(ref, top)
        grow = tl.exp2(ref - ref_new)
        if PV_FP8:
            p = tl.exp2(s * scale - (ref_new - 8.0)[:, None])  # 256 exp2(s - ref): eight_bit.P_SCALE
            l8 = l8 * grow + tl.sum(p, 1)
            if EMULATE_FP8:
                p = e4m3_grid(p)
            part = part * grow[:, None] + tl.dot(p.to(tl.float8e4nv), vt)
        else:
            own = tl.where(top == float("-inf"), ref_new, top)
            p = tl.exp2(s * scale - own[:, None])
            w = tl.exp2(own - ref_new)
            l8 = l8 * grow + tl.sum(p, 1) * w
            pv = tl.dot((p * 127.0 + 0.5).to(tl.int8), vt, out_dtype=tl.int32).to(tl.float32)
            part = part * grow[:, None] + pv * w[:, None]
        ref = ref_new
        live = t + 1 < n_tiles
        blk = tl.load(sel_row + (t + 1) // SUB, mask=live, other=0).to(tl.int32)
        blen = tl.load(BlockLen + blk, mask=live, other=0)
        k_scale = tl.load(KS + bh * J + blk, mask=live, other=0.0)
    # one softmax with what came before: the part's max is ref + q . key mean (base 2)
    m8 = ref + tl.load(QShift + bh * L + qslot) * qk_scale
    m_new = tl.maximum(m_i, m8)
    alpha = tl.exp2(m_i - m_new)
    beta = tl.exp2(m8 - m_new)
    v_scale = tl.load(VS + bh * HEAD_DIM + offs_d)
    if PV_FP8:  # the sum and the codes were of 256 p
        l_i = l_i * alpha + l8 * (beta * (1.0 / 256.0))
        acc = acc * alpha[:, None] + part * (beta * (1.0 / 256.0))[:, None] * v_scale[None, :]
    else:  # the sum was of p, the codes of 127 p
        l_i = l_i * alpha + l8 * beta
        acc = acc * alpha[:, None] + part * (beta * (1.0 / 127.0))[:, None] * v_scale[None, :]
    return acc, m_new, l_i


@triton.jit
def _next_picks(sel_row, done, n_pick, offs_t, past):
    """The pick list's entries [done, done + BLOCK_T) as int32, `past` beyond its n_pick entries."""
    p = done + offs_t
    near = p < n_pick
    return tl.where(near, tl.load(sel_row + p, mask=near, other=0).to(tl.int32), past)


@triton.jit(do_not_specialize=['sl_b', 'sl_h', 'sp_b', 'sp_h', 'spl_b', 'spl_h', 'H', 'H0', 'HC', 'J', 'R'])
def _block_sparse_fwd(
    Q, K, V, Out, Lse,
    QPerm, KPerm, BlockLen, DenseHi, Q2kIdx, Q2kNum,
    TailK, TailV, TailBias, BlockLogit, BlockValue, PartOut, PartLse,
    QC, QS, QShift, KC, KS, VC, VS,
    sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
    so_b, so_h, so_s, so_d, sl_b, sl_h, sl_s,
    sqp_b, sqp_h, skp_b, skp_h, sp_b, sp_h, spl_b, spl_h,
    H, H0, HC, J, R, qk_scale,
    BS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    QUERY_TAIL: tl.constexpr, BLOCK_TAIL: tl.constexpr, FROM_PARTIAL: tl.constexpr, TILED: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, EMPTY_LSE: tl.constexpr, ROW_DTYPE: tl.constexpr,
    EIGHT_BIT: tl.constexpr, PV_FP8: tl.constexpr, EMULATE_FP8: tl.constexpr,
):
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    SPLIT: tl.constexpr = BS // BLOCK_M  # programs per query block
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)  # (batch, head among this launch's HC heads [H0, H0 + HC))
    b = (bh // HC).to(tl.int64)
    h = (H0 + bh % HC).to(tl.int64)  # the global head: Out, Lse, the permutations and the tables have all H
    i = pid_m // SPLIT
    bh_all = b * H + h
    row = bh_all * J + i  # (b, h, i) row of the per-block tables
    offs_m = (pid_m % SPLIT) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)

    qrow = tl.load(QPerm + b * sqp_b + h * sqp_h + i * BS + offs_m)
    qmask = qrow >= 0
    if TILED:
        # Q, K, V packed contiguous [B, HC, J * BS, HEAD_DIM]: this (b, h) starts at row bh * J * BS
        tile_base = bh.to(tl.int64) * J * (BS * HEAD_DIM)
        qslot = tl.max_contiguous(tl.multiple_of(i * BS + offs_m, BLOCK_M), BLOCK_M)
        q = tl.load(Q + tile_base + qslot.to(ROW_DTYPE)[:, None] * HEAD_DIM + offs_d[None, :]).to(DOT_DTYPE)
    else:  # gather-on-load of this tile's query rows
        q = tl.load(Q + b * sq_b + h * sq_h + qrow.to(ROW_DTYPE)[:, None] * sq_s + offs_d[None, :] * sq_d,
                    mask=qmask[:, None], other=0.0).to(DOT_DTYPE)

    sel_row = Q2kIdx + row * R
    dh = tl.load(DenseHi + i)
    n_slots = dh + tl.load(Q2kNum + row)  # list: dense prefix [0, dh), then the picks

    if FROM_PARTIAL:
        # the exact keys were computed elsewhere: start from their normalised rows (tiled order) and
        # log-sum-exp (natural; -inf or EMPTY_LSE: nothing, NaN stays NaN), as one key of that mass
        slot = i * BS + offs_m
        # a partial is contiguous [B, H, L, D] with L a multiple of the block size (>= 16)
        p_lse = tl.load(PartLse + tl.multiple_of(b * spl_b + h * spl_h, 16) + slot)
        has = ~(p_lse < EMPTY_LSE * 0.5)
        m_i = tl.where(has, p_lse * LOG2E, -1.0e30)
        l_i = tl.where(has, 1.0, 0.0)
        acc = tl.load(PartOut + tl.multiple_of(b * sp_b + h * sp_h, 16 * HEAD_DIM) + slot[:, None] * HEAD_DIM
                      + offs_d[None, :]).to(tl.float32)
        acc = tl.where(has[:, None], acc, 0.0)
    else:  # the exact keys: the dense prefix, then the picks
        # a finite start keeps exp2(m_old - m_new) defined when a whole tile is masked
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if TILED:
            acc, m_i, l_i = _tiled_keys(acc, m_i, l_i, q, K + tile_base, V + tile_base, BlockLen, sel_row, dh, n_slots,
                                        qk_scale, offs_d, BS, HEAD_DIM, BLOCK_N, DOT_DTYPE, PRECISION, ROW_DTYPE)
        else:  # 8-bit: the gathered keys are the dense prefix only, in the inputs' precision
            acc, m_i, l_i = _gathered_keys(acc, m_i, l_i, q, K + b * sk_b + h * sk_h, V + b * sv_b + h * sv_h,
                                           KPerm + b * skp_b + h * skp_h, BlockLen, sel_row, dh,
                                           dh if EIGHT_BIT else n_slots, qk_scale, sk_s, sk_d, sv_s, sv_d, offs_d,
                                           BS, BLOCK_N, DOT_DTYPE, PRECISION, ROW_DTYPE)
            if EIGHT_BIT:
                acc, m_i, l_i = _quantised_keys(acc, m_i, l_i, QC, QS, QShift, KC, KS, VC, VS, BlockLen, sel_row,
                                                n_slots - dh, bh.to(tl.int64), i, J, offs_m, offs_d, qk_scale, BS,
                                                HEAD_DIM, BLOCK_N, PV_FP8, EMULATE_FP8)

    if QUERY_TAIL:
        # candidate blocks [dh, J) not selected: one summary column each. The picks are ascending and
        # inside [dh, J), so those inside [c0, c0 + BLOCK_T) are among the next BLOCK_T entries after
        # the `done` ones below c0; a histogram of their offsets marks the selected columns. Those
        # entries are loaded one step ahead, so no step waits on a load that depends on the last one
        offs_t = tl.arange(0, BLOCK_T)
        t_row = bh_all * J
        n_pick = n_slots - dh
        done = 0
        picks = _next_picks(sel_row, done, n_pick, offs_t, J + BLOCK_T)
        for c0 in range(dh, J, BLOCK_T):
            c = c0 + offs_t
            cin = c < J
            rel = picks - c0
            below = rel < BLOCK_T  # consumed at this step (past the list's end: never)
            here = below & (rel >= 0)
            hit = tl.histogram(tl.where(here, rel, 0), BLOCK_T, mask=here) > 0
            done += tl.sum(below.to(tl.int32), 0)
            # the next step's picks, loaded now: the load is in flight during this step's dots
            picks = _next_picks(sel_row, done, n_pick, offs_t, J + BLOCK_T)
            keep = cin & ~hit
            tk = tl.load(TailK + (t_row + c[None, :]) * HEAD_DIM + offs_d[:, None],
                         mask=cin[None, :], other=0.0).to(DOT_DTYPE)
            bias = tl.load(TailBias + t_row + c, mask=cin, other=0.0)
            tv = tl.load(TailV + (t_row + c[:, None]) * HEAD_DIM + offs_d[None, :],
                         mask=cin[:, None], other=0.0).to(DOT_DTYPE)
            # the bias (natural log) in the units of an unscaled logit
            s = (tl.dot(q, tk, input_precision=PRECISION)
                 + tl.where(keep, bias * (LOG2E / qk_scale), float("-inf"))[None, :])
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, qk_scale, tv, DOT_DTYPE, PRECISION)

    if BLOCK_TAIL:
        # one virtual key per query block, shared by its rows: log-mass and normalised value
        logit = tl.load(BlockLogit + row) * LOG2E
        value = tl.load(BlockValue + row * HEAD_DIM + offs_d)
        m_new = tl.maximum(m_i, logit)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(logit - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * value[None, :]
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, EMPTY_LSE, (m_i + tl.log2(l_safe)) * LN2)
    # scatter-on-store straight to the model-order rows
    orow = qrow.to(ROW_DTYPE)
    tl.store(Out + b * so_b + h * so_h + orow[:, None] * so_s + offs_d[None, :] * so_d,
             out.to(Out.dtype.element_ty), mask=qmask[:, None])
    tl.store(Lse + b * sl_b + h * sl_h + orow * sl_s, lse, mask=qmask)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or t.shape != q.shape:
            raise SparseAttentionError(f"block_sparse_triton: {name} must be [B, H, S, D] like q, got {tuple(t.shape)}")
        if t.dtype not in DTYPES or t.dtype != q.dtype:
            raise SparseAttentionError(f"block_sparse_triton: {name}.dtype={t.dtype} is not supported: expected q's dtype, "
                             f"one of {', '.join(str(d) for d in DTYPES)}")
    D = q.shape[-1]
    if D < 16 or D & (D - 1):
        raise SparseAttentionError(f"block_sparse_triton: head_dim={D} is not supported: expected a power of two >= 16")
    bs = plan.block_size
    if bs < 16 or bs & (bs - 1):
        raise SparseAttentionError(f"block_sparse_triton: plan.block_size={bs} is not supported: expected a power of two >= 16")
    tail = plan.tail
    tail_dim = tail.key.shape[-1] if isinstance(tail, QuerySummaries) else (
        tail.value.shape[-1] if isinstance(tail, BlockSummaries) else D)
    if tail_dim != D or plan.q_perm.device != q.device:
        raise SparseAttentionError(f"block_sparse_triton: the plan ({plan.q_perm.device}, summaries of size {tail_dim}) does not "
                         f"fit q {tuple(q.shape)} on {q.device}")
    if plan.q2k_idx.shape[:2] != q.shape[:2]:
        raise SparseAttentionError(f"block_sparse_triton: plan.q2k_idx {tuple(plan.q2k_idx.shape)} does not fit q's batch and "
                         f"heads {tuple(q.shape[:2])}")


def _checked_partial(partial: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, plan: BlockSparsePlan
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = partial
    B, H, _, D = q.shape
    L = plan.num_blocks * plan.block_size
    if (out.shape != (B, H, L, D) or lse.shape != (B, H, L) or lse.dtype != torch.float32
            or out.device != q.device or lse.device != q.device):
        raise SparseAttentionError(f"block_sparse_triton: partial must be (out [{B}, {H}, {L}, {D}], lse fp32 [{B}, {H}, {L}]) "
                         f"on {q.device}, got {tuple(out.shape)} {out.dtype}, {tuple(lse.shape)} {lse.dtype}")
    return out.contiguous(), lse.contiguous()


def block_sparse_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                        config: KernelConfig | None = None,
                        partial: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                        tiled: bool = True, precision: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention of q, k, v [B, H, S, D] under `plan` with the fused Triton kernel.

    Args:
        q, k, v: one fp16/bf16/fp32 dtype, head_dim a power of two >= 16, any strides.
        plan: the plan; every model row must appear once in q_perm (true of every tiling). Logits
            are scaled by head_dim ** -0.5.
        config: tile sizes and launch parameters instead of the per-architecture choice
            (`arch.kernel_config`).
        partial: the exact keys' attention computed by another kernel, (out [B, H, J * block_size, D]
            normalised, in tiled order; lse [B, H, J * block_size] fp32 natural log, -inf for
            nothing): the kernel then skips the exact keys, adds the tail to these rows in the same
            softmax and stores them in model order (k and v are not read).
        tiled: read the exact keys from Q/K/V packed HEADS_PER_CALL heads at a time (True) or
            gather their rows through the permutations (False: no packed copies, the mode to compare
            with where tiled mode is not measured faster). Ignored with `partial` and in 8 bits.
        precision: "bf16" (the inputs' precision) or "8-bit": the selected key blocks in 8-bit
            arithmetic (`eight_bit`; Q/K/V quantised HEADS_PER_CALL heads at a time by
            `block_quantise`), the dense prefix and the tail in the inputs' precision (read as in gather
            mode); `config` is then an `EightBitConfig` (default `arch.eight_bit_config`).
    Returns:
        (out [B, H, S, D] in q's dtype and model order, lse [B, H, S] fp32 natural log; rows with
        nothing allowed get zeros and EMPTY_ROW_LSE).
    """
    _check(q, k, v, plan)
    B, H, S, D = q.shape
    J, bs = plan.num_blocks, plan.block_size
    scale = D ** -0.5
    eight_bit = _check_precision(precision, partial, config, D, bs)
    if config is not None:
        cfg = config
    else:
        cfg = eight_bit_config(D, bs, q.device) if eight_bit else kernel_config(D, bs, q.device)
    block_m, block_n = min(cfg.block_m, bs), min(cfg.block_n, bs)  # tiles never span two blocks
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    # bf16 tl.dot is wrong in the CPU interpreter, and fp32 dots are faster there anyway
    dot_dtype = tl.float32 if interpret or q.dtype == torch.float32 else (
        tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    precision = dot_precision(q.dtype)

    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    q_perm, k_perm = plan.q_perm.contiguous(), plan.k_perm.contiguous()
    q2k_idx, q2k_num = plan.q2k_idx.contiguous(), plan.q2k_num.contiguous()
    query_tail = isinstance(plan.tail, QuerySummaries)
    block_tail = isinstance(plan.tail, BlockSummaries)
    tail_k = plan.tail.key.contiguous() if query_tail else q
    tail_v = plan.tail.value.contiguous() if query_tail else q
    tail_bias = plan.tail.bias.float().contiguous() if query_tail else lse
    block_logit = plan.tail.logit.float().contiguous() if block_tail else lse
    block_value = plan.tail.value.float().contiguous() if block_tail else lse
    part_out, part_lse = (q, lse) if partial is None else _checked_partial(partial, q, plan)
    from_partial = partial is not None
    tiled = tiled and not from_partial and not eight_bit

    def launch(qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, h0: int, hc: int,
               codes: QuantisedBlocks | None = None) -> None:
        """The kernel on heads [h0, h0 + hc) of q, k, v given as qx, kx, vx (packed in tiled mode),
        with their 8-bit `codes` in 8 bits."""
        c = codes or QuantisedBlocks(*(lse,) * 7)  # unread without EIGHT_BIT
        _block_sparse_fwd[(J * (bs // block_m), B * hc)](
            qx, kx, vx, out, lse,
            q_perm, k_perm, plan.block_len.contiguous(), plan.dense_hi.contiguous(), q2k_idx, q2k_num,
            tail_k, tail_v, tail_bias, block_logit, block_value, part_out, part_lse,
            c.q_codes, c.q_scale, c.q_shift, c.k_codes, c.k_scale, c.v_codes, c.v_scale,
            *qx.stride(), *kx.stride(), *vx.stride(), *out.stride(), *lse.stride(),
            *perm_strides(q_perm), *perm_strides(k_perm),
            part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1),
            H, h0, hc, J, q2k_idx.shape[-1], scale * 1.4426950408889634,
            BS=bs, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=cfg.block_t,
            QUERY_TAIL=query_tail, BLOCK_TAIL=block_tail, FROM_PARTIAL=from_partial, TILED=tiled,
            DOT_DTYPE=dot_dtype, PRECISION=precision, EMPTY_LSE=EMPTY_ROW_LSE,
            ROW_DTYPE=tl.int64 if wide_rows(qx, kx, vx, out) else tl.int32,  # narrow offsets: half the address math
            EIGHT_BIT=eight_bit, PV_FP8=eight_bit and cfg.pv == "fp8", EMULATE_FP8=eight_bit and interpret,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    if eight_bit:
        mean, v_max = key_mean(k), value_max(v)
        for h0 in range(0, H, HEADS_PER_CALL):
            h1 = min(H, h0 + HEADS_PER_CALL)
            launch(q, k, v, h0, h1 - h0,
                   quantise_blocks_triton(q, k, v, q_perm, k_perm, mean, v_max, bs, h0, h1, cfg.pv))
        return out, lse
    if not tiled:
        launch(q, k, v, 0, H)
        return out, lse
    for h0 in range(0, H, HEADS_PER_CALL):
        h1 = min(H, h0 + HEADS_PER_CALL)
        launch(*pack_qkv(q[:, h0:h1], k[:, h0:h1], v[:, h0:h1], perm_heads(q_perm, h0, h1),
                         perm_heads(k_perm, h0, h1)), h0, h1 - h0)
    return out, lse


def add_tail(q: torch.Tensor, plan: BlockSparsePlan, partial: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_sparse_triton(q, q, q, plan, partial=partial)` at the finishing config (`configs.finish_config`):
    the tail added to another kernel's exact-key result, rows stored in model order (what the `triton`
    family's helper "add_tail" runs, through its custom op in `op.py`)."""
    return block_sparse_triton(q, q, q, plan, finish_config(q.shape[-1], plan.block_size, q.device), partial)


def _check_precision(precision: str, partial: object, config: KernelConfig | None, head_dim: int,
                     block_size: int) -> bool:
    """Whether the call runs in 8 bits; raises on a precision, config or shape the 8-bit loop cannot take."""
    if precision not in PRECISIONS:
        raise SparseAttentionError(f"block_sparse_triton: precision={precision!r} is not allowed: expected one of "
                         f"{', '.join(map(repr, PRECISIONS))}")
    if precision != "8-bit":
        if isinstance(config, EightBitConfig):
            raise SparseAttentionError("block_sparse_triton: an EightBitConfig needs precision='8-bit'")
        return False
    if partial is not None:
        raise SparseAttentionError("block_sparse_triton: precision='8-bit' computes the exact keys itself: it takes no partial")
    if config is not None and not isinstance(config, EightBitConfig):
        raise SparseAttentionError(f"block_sparse_triton: precision='8-bit' needs an EightBitConfig, got {config!r}")
    if min(head_dim, block_size) < 32:
        raise SparseAttentionError(f"block_sparse_triton: precision='8-bit' needs head_dim and block_size >= 32 (8-bit MMA "
                         f"reduces 32 at a time), got head_dim={head_dim}, block_size={block_size}")
    return True
