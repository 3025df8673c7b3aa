"""Warp-specialised Hopper (sm90) kernel of the exact keys of block-sparse attention, in Gluon.

One CTA per (packed head, 64-row query block). Its key list is the dense prefix [0, dense_hi)
followed by the block's picks q2k_idx[:q2k_num] (the plan's own tables, read in the kernel: no
list is built). (Given a 128-row Q descriptor and 8 warps, a CTA takes two adjacent query blocks on the
first one's list, for plans routed in pairs: `tools/sm90_pair_probe.py`.) Three partitions share the CTA:
- two loaders (one warp each, few registers), one for K and one for V, walk the list and issue one
  TMA copy of each listed key block's rows into their own ring (`STAGES` slots each), each slot with
  a "ready" mbarrier (the copy engine signals it) and a "free" one (the consumer signals it), so
  neither ring waits for the other's slots; the next block's index is read a step ahead;
- the consumer (one warpgroup, 232 registers a thread by `setmaxnreg`) runs S = Q.K^T with `wgmma`, Q
  held in registers and K from shared memory, the online softmax in registers (base 2, the scale
  folded into one multiply-add, keys beyond an edge block's true length masked, the next block's
  length read a step ahead), then O += P.V with P from registers; K's slot is freed as soon as S is
  read, V's when its MMA retires. While the softmax of block t runs, the logits of block t+1 and P.V
  of block t-1 are in flight, so the tensor cores and the softmax overlap within the warpgroup, and
  two CTAs an SM (`MAXNREG`, 82 KB of shared memory) overlap each other.
The output is the exact keys' part only: rows normalised over their exact keys and their natural
log-sum-exp, in tiled order (as the cuDNN kernel returns it); the Triton family's `add_tail` joins
the tail summaries to it in the same softmax and stores rows in model order.

Importing this module imports Triton and Gluon: the family imports it only on demand.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...errors import SparseAttentionError
from ..plan import BlockSparsePlan

BLOCK = 64  # query and key block rows: one warpgroup's wgmma M, the plan's block size
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
HEAD_DIMS = (64, 128)
STAGES = (2, 2)  # slots of the K ring and of the V ring
MAXNREG = 128  # registers a thread at launch: two CTAs (8 warps each, the loaders' warpgroup included) an SM


@gluon.jit
def _key_block(t, dh, n_keys, sel_row):
    """Key block at position t of a query block's list: the dense prefix [0, dh), then the picks (0, a
    harmless index, past the end of the list)."""
    picked = gl.load(sel_row + (t - dh), mask=(t >= dh) & (t < n_keys), other=0).to(gl.int32)
    return gl.where(t < dh, t, picked)


@gluon.jit
def _loader(desc, bufs, ready, free, sel_row, dh, n_keys, key_base):
    """A loader partition: TMA copies of each listed key block's rows of `desc` (K, or V) into its ring. K
    and V have a loader each, so neither ring waits for the other's slots; the next block's index is read
    one step ahead, so no copy waits on an index load."""
    SLOTS: gl.constexpr = bufs.type.shape[0]
    BN: gl.constexpr = bufs.type.shape[1]
    blk = _key_block(0, dh, n_keys, sel_row)
    for t in range(n_keys):
        blk_next = _key_block(t + 1, dh, n_keys, sel_row)
        slot = t % SLOTS
        mbarrier.wait(free.index(slot), ((t // SLOTS) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [key_base + blk * BN, 0], ready.index(slot), bufs.index(slot))
        blk = blk_next


@gluon.jit
def _logits(q, k_bufs, k_ready, t, zero):
    """Issue S = Q.K^T of list position t on the tensor cores (asynchronous: the caller waits on it)."""
    KS: gl.constexpr = k_bufs.type.shape[0]
    mbarrier.wait(k_ready.index(t % KS), (t // KS) & 1)
    return warpgroup_mma(q, k_bufs.index(t % KS).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _softmax(s, blen, cols, m_i, l_i, qk_scale):
    """One block's step of the online softmax (base 2, keys past the block's true length masked): the block's
    probabilities (fp32), the output's rescale factor, the new row max and sum."""
    s = gl.where(gl.expand_dims(cols < blen, 0), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _accumulate(o, p, alpha, v_bufs, v_ready, v_free, t, p_layout: gl.constexpr, row_o: gl.constexpr):
    """Free the V slot of position t - 1 (its P.V has retired), rescale the output and issue P.V of position t.

    P becomes wgmma's register operand only here, after the previous P.V retired: an MMA in flight reads its
    A registers until then, and the loop writes the same registers for every block's P."""
    VS: gl.constexpr = v_bufs.type.shape[0]
    p_op = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
    if t > 0:
        mbarrier.arrive(v_free.index((t - 1) % VS), count=1)
    o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    mbarrier.wait(v_ready.index(t % VS), (t // VS) & 1)
    return warpgroup_mma(p_op, v_bufs.index(t % VS), o, is_async=True)


@gluon.jit
def _consumer(q_desc, q_smem, q_bar, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, BlockLen, sel_row, dh, n_keys,
              q_row, out_row, qk_scale, PartOut, PartLse):
    """The consumer warpgroup: the online softmax over the listed key blocks of the Q rows from `q_row`; stores
    the normalised rows and their natural log-sum-exp (-inf for a row with no key) from `out_row`.

    Q is held in registers (the logits read only K from shared memory, which at N = 64 would otherwise
    read shared memory at its full rate). The MMAs retire in issue order, S_0 | S_1, PV_0 | S_2, PV_1 | ...:
    step t issues S_{t+1}, runs the softmax of S_t beside it and beside PV_{t-1}, retires both with one wait
    (the logits are done by then) and issues PV_t, which runs beside the next step's logits and softmax. The
    last step is peeled off and the last P.V retired inside its branch, so no register of an MMA in flight
    is copied at a join (ptxas would wait there, serialising the MMAs, or the copy would read them early)."""
    KS: gl.constexpr = k_bufs.type.shape[0]
    BM: gl.constexpr = q_smem.type.shape[0]
    BN: gl.constexpr = k_bufs.type.shape[1]
    D: gl.constexpr = q_smem.type.shape[1]
    LN2: gl.constexpr = 0.6931471805599453
    W: gl.constexpr = gl.num_warps()  # 4 a warpgroup, 64 rows each
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    mbarrier.wait(q_bar, 0)
    q = q_smem.load(q_layout)

    m_i = gl.full([BM], -1.0e30, gl.float32, row_s)  # finite: exp2(m_old - m_new) stays defined
    l_i = gl.zeros([BM], gl.float32, row_s)
    zero = gl.zeros([BM, BN], gl.float32, s_layout)
    o = gl.zeros([BM, D], gl.float32, o_layout)
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    if n_keys > 0:
        acc = warpgroup_mma_init(o)
        s = warpgroup_mma_wait(0, deps=[_logits(q, k_bufs, k_ready, 0, zero)])
        mbarrier.arrive(k_free.index(0), count=1)
        blen = gl.load(BlockLen + _key_block(0, dh, n_keys, sel_row))
        for t in range(n_keys - 1):
            # the next block's length, read now: its load is in flight during this block's MMAs
            blen_next = gl.load(BlockLen + _key_block(t + 1, dh, n_keys, sel_row))
            s_next = _logits(q, k_bufs, k_ready, t + 1, zero)
            p, alpha, m_i, l_i = _softmax(s, blen, cols, m_i, l_i, qk_scale)
            o, s = warpgroup_mma_wait(0, deps=[acc, s_next])  # PV_{t-1} and S_{t+1}
            mbarrier.arrive(k_free.index((t + 1) % KS), count=1)
            acc = _accumulate(o, p, alpha, v_bufs, v_ready, v_free, t, p_layout, row_o)
            blen = blen_next
        p, alpha, m_i, l_i = _softmax(s, blen, cols, m_i, l_i, qk_scale)
        o = warpgroup_mma_wait(0, deps=[acc])
        acc = _accumulate(o, p, alpha, v_bufs, v_ready, v_free, n_keys - 1, p_layout, row_o)
        o = warpgroup_mma_wait(0, deps=[acc])  # retired inside the branch: nothing in flight is joined

    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    out = o / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
    rows = out_row + gl.arange(0, BM, layout=row_o)
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(PartOut + gl.expand_dims(rows.to(gl.int64) * D, 1) + gl.expand_dims(dims, 0), out.to(q_smem.dtype))
    gl.store(PartLse + out_row + gl.arange(0, BM, layout=row_s), lse)


@gluon.jit(do_not_specialize=["J", "R", "HC", "H0", "H"])
def _exact_keys_sm90(q_desc, k_desc, v_desc, PartOut, PartLse, BlockLen, DenseHi, Q2kIdx, Q2kNum,
                     H, H0, HC, J, R, qk_scale, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    PER: gl.constexpr = BM // BN  # query blocks a CTA (one warpgroup each), all on the first one's list
    p = gl.program_id(0)
    i = p * PER  # the CTA's first query block
    bh = gl.program_id(1)  # (batch, head of this chunk)
    b = bh // HC
    row = (b * H + H0 + bh % HC).to(gl.int64) * J + i  # (b, h, i) row of the plan's tables (all H heads)
    sel_row = Q2kIdx + row * R
    dh = gl.load(DenseHi + i)
    n_keys = dh + gl.load(Q2kNum + row)
    base = bh * J * BN  # this (batch, head)'s first packed row
    q_row = base + i * BN
    out_row = (bh * ((J + PER - 1) // PER) + p) * BM  # the output holds a multiple of PER blocks a head

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(k_free.index(s), count=1)
    for s in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(v_free.index(s), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (q_desc, q_smem, q_bar, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, BlockLen, sel_row, dh,
                     n_keys, q_row, out_row, qk_scale, PartOut, PartLse)),
        (_loader, (k_desc, k_bufs, k_ready, k_free, sel_row, dh, n_keys, base)),
        (_loader, (v_desc, v_bufs, v_ready, v_free, sel_row, dh, n_keys, base)),
    ], [1, 1], [24, 24])


def shared_layout(head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The swizzled shared-memory layout of one [64, head_dim] tile (TMA's and wgmma's)."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK, head_dim], DTYPES[dtype])


def exact_keys_sm90(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, plan: BlockSparsePlan,
                    heads: tuple[int, int], stages: tuple[int, int] = STAGES, maxnreg: int = MAXNREG
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact keys' attention of one packed head chunk on the sm90 kernel, in tiled order.

    Args:
        qp, kp, vp: heads [h0, h1) of Q/K/V packed into tiled order, [B, h1 - h0, J * 64, D] contiguous,
            bf16 or fp16, D in HEAD_DIMS.
        plan: the plan (block size 64); its tables cover all heads.
        heads: (h0, h1).
        stages: slots of the K ring and of the V ring (2 and 2 give two CTAs an SM at head dim 128).
        maxnreg: the register cap a thread (sets how many CTAs share an SM).
    Returns:
        (out [B, h1 - h0, J * 64, D] normalised over the exact keys, lse [B, h1 - h0, J * 64] fp32 natural
        log, -inf where a row has no key).
    """
    B, hc, L, D = qp.shape
    J = plan.num_blocks
    if plan.block_size != BLOCK or L != J * BLOCK or D not in HEAD_DIMS or qp.dtype not in DTYPES:
        raise SparseAttentionError(
            f"exact_keys_sm90: packed q {tuple(qp.shape)} {qp.dtype}, block_size {plan.block_size}: expected "
            f"[B, h, J * {BLOCK}, D] with D in {HEAD_DIMS}, dtype in {tuple(DTYPES)}, block_size {BLOCK}")
    layout = shared_layout(D, qp.dtype)
    q_desc, k_desc, v_desc = (TensorDescriptor.from_tensor(t.view(B * hc * L, D), [BLOCK, D], layout)
                              for t in (qp, kp, vp))
    out = torch.empty_like(qp)
    lse = torch.empty(B, hc, L, dtype=torch.float32, device=qp.device)
    q2k_idx = plan.q2k_idx.contiguous()
    _exact_keys_sm90[(J, B * hc)](
        q_desc, k_desc, v_desc, out, lse, plan.block_len.contiguous(), plan.dense_hi.contiguous(), q2k_idx,
        plan.q2k_num.contiguous(), plan.q2k_idx.shape[1], heads[0], hc, J, q2k_idx.shape[-1],
        D ** -0.5 * 1.4426950408889634, K_STAGES=stages[0], V_STAGES=stages[1], num_warps=4, maxnreg=maxnreg)
    return out, lse
