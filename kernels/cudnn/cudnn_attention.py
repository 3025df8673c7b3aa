"""Optional kernel family: the exact keys on NVIDIA cuDNN-frontend's block-sparse kernel (CuTe DSL).

cuDNN's kernel reads K/V blocks as contiguous rows, so a call packs Q/K/V into tiled order a few
heads at a time (bounded extra memory; one fused gather, the Triton family's helper `tiled_pack`)
and gives it the key list of every query block: the dense prefix [0, dense_hi) followed by the
picks. Sparse query blocks (the span of the plan's groups, whose prefix is the span's start) and
dense ones (every key block) are two calls, so no J x J table is built. The tail joins afterwards:
the Triton kernel starts its online softmax from cuDNN's normalised rows and log-sum-exp (its
helper `add_tail`), adds the summaries, normalises once and stores rows in model order. Same
semantics as the reference. Both helpers are handed in (`family.py` declares them borrowed, the
registry loads them): this package imports only the kernels root.

The package `nvidia-cudnn-frontend` (with `nvidia-cutlass-dsl`) is optional: without it, or on a
GPU architecture it is not enabled for, it is unavailable; where it runs, `auto` takes it
(`kernels/registry.py`).
"""
from __future__ import annotations

from typing import Callable

import torch

from ...errors import SparseAttentionError
from ..packed import exact_in_chunks
from ..plan import BlockSparsePlan, group_span

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)  # cuDNN also runs 96; the Triton kernel that adds the tail needs a power of two
BLOCK_SIZE = 64
ARCHS = (9,)  # sm major versions enabled: sm90, measured; sm100/sm120 have kernels in the package, not measured here
HEADS_PER_CALL = 8  # packed Q/K/V copies stay at most 8 / H of Q/K/V's size


def check_call(q: torch.Tensor, plan: BlockSparsePlan) -> None:
    """Raise ValueError unless q's device, dtype and head dim and the plan's block size are ones
    this kernel takes (the table, `family.REQUIRES`, declares the same facts for `auto`)."""
    if q.device.type != "cuda" or q.dtype not in DTYPES or q.shape[-1] not in HEAD_DIMS or plan.block_size != BLOCK_SIZE:
        raise SparseAttentionError(f"block_sparse_cudnn cannot run: q {q.dtype} head_dim {q.shape[-1]} on {q.device}, block_size "
                         f"{plan.block_size}: expected CUDA, dtype in {DTYPES}, head_dim in {HEAD_DIMS}, block_size {BLOCK_SIZE}")


def sparse_span(plan: BlockSparsePlan) -> tuple[int, int]:
    """[lo, hi) sparse query blocks: the span of the plan's groups (`plan.group_span`)."""
    if not plan.groups:
        raise SparseAttentionError("block_sparse_cudnn: plan.groups is empty: the cuDNN backend needs the routing groups "
                         "(route_plan's rule: query blocks in their span are sparse with the span's start as "
                         "dense prefix, the others dense)")
    return group_span(plan.groups)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, num: torch.Tensor,
             block_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from cudnn.block_sparse_attention import block_sparse_attention_forward

    res = block_sparse_attention_forward(q, k, v, index, block_sizes=block_len, q2k_block_nums=num,
                                         allow_empty_block_nums=True)
    return res["o_tensor"], res["lse_tensor"]


def key_lists(plan: BlockSparsePlan, blocks: tuple[int, int], heads: tuple[int, int], cap: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's key list of query blocks [lo, hi) and heads [h0, h1): the dense prefix [0, dense_hi)
    then the picks, built on the device (int32 [B, h, n, cap], and the counts int32 [B, h, n]).
    Every row's list must fit `cap` (dense_hi + q2k_num <= cap)."""
    (lo, hi), (h0, h1) = blocks, heads
    dh = plan.dense_hi[lo:hi].view(1, 1, -1, 1)
    picks = plan.q2k_idx[:, h0:h1, lo:hi]
    if picks.shape[-1] == 0:  # no picks anywhere (R = 0): one unread entry keeps the gather defined
        picks = picks.new_zeros(*picks.shape[:3], 1)
    p = torch.arange(cap, dtype=torch.int32, device=dh.device).view(1, 1, 1, cap)
    at = (p - dh).clamp(0, picks.shape[-1] - 1).long().expand(picks.shape[0], picks.shape[1], -1, -1)
    index = torch.where(p < dh, p, picks.gather(-1, at).to(torch.int32).clamp(min=0))
    return index.contiguous(), (plan.q2k_num[:, h0:h1, lo:hi] + dh.view(1, 1, -1)).contiguous()


def cudnn_calls(plan: BlockSparsePlan, qp: torch.Tensor, heads: tuple[int, int]
                ) -> list[tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The cuDNN calls of heads [h0, h1) given their packed queries qp [B, h, J * bs, D]: per call
    (its slot ranges, their query rows, key lists, counts). The groups' span (at most span-start
    + R keys: the route rule's prefix is the span's start) and the other query blocks (lists of up
    to J blocks) are separate calls, so no J x J table is built."""
    J, bs, R = plan.num_blocks, plan.block_size, plan.q2k_idx.shape[-1]
    lo, hi = sparse_span(plan)
    parts = [([(lo, hi)], lo + R)] if hi > lo else []  # (block ranges, key-list capacity) per call
    outside = [(a, b) for a, b in ((0, lo), (hi, J)) if b > a]
    if outside:
        parts.append((outside, J))
    calls = []
    for spans, cap in parts:
        lists = [key_lists(plan, span, heads, cap) for span in spans]
        rows = [(a * bs, b * bs) for a, b in spans]
        qs = qp[:, :, rows[0][0]:rows[0][1]] if len(rows) == 1 else torch.cat([qp[:, :, a:b] for a, b in rows], 2)
        calls.append((rows, qs, torch.cat([i for i, _ in lists], dim=2), torch.cat([n for _, n in lists], dim=2)))
    return calls


def exact_keys(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, plan: BlockSparsePlan, heads: tuple[int, int],
               forward: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact keys' attention of one head chunk on cuDNN (`cudnn_calls`), in tiled order.

    Args:
        qp, kp, vp: heads [h0, h1) of Q/K/V packed into tiled order, [B, h1 - h0, J * 64, D] contiguous.
        plan: the plan (block size 64).
        heads: (h0, h1).
        forward: cuDNN's call (tests pass an emulation of its contract).
    Returns:
        (out [B, h1 - h0, J * 64, D] normalised over the exact keys, lse [B, h1 - h0, J * 64] fp32
        natural log, -inf where a row has no key); padding slots hold whatever cuDNN leaves there.
    """
    forward = _forward if forward is None else forward
    B, hc, L, D = qp.shape
    block_len = plan.block_len.contiguous()
    out = torch.empty(B, hc, L, D, dtype=qp.dtype, device=qp.device)
    lse = torch.empty(B, hc, L, dtype=torch.float32, device=qp.device)
    for rows, qs, index, num in cudnn_calls(plan, qp, heads):
        o, s = forward(qs, kp, vp, index, num, block_len)
        start = 0
        for a, b in rows:
            out[:, :, a:b] = o[:, :, start:start + b - a]
            lse[:, :, a:b] = s[:, :, start:start + b - a]
            start += b - a
    return out, lse


def exact_attention_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                          tiled_pack: Callable, exact: Callable = exact_keys) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact keys' attention of every query row, in tiled order: HEADS_PER_CALL heads at a time
    packed by `tiled_pack`, then `exact` on them.

    Args:
        q, k, v: [B, H, S, D] in model order.
        plan: the plan (block size 64).
        tiled_pack: the Triton family's helper "tiled_pack" ((q, k, v, q_perm, k_perm) -> packed q, k, v).
        exact: (qp, kp, vp, plan, (h0, h1)) -> (out, lse) of one head chunk: `exact_keys` (the cuDNN
            attention passes its custom op, tests an emulation of cuDNN).
    Returns:
        (out [B, H, J * 64, D] normalised over the exact keys, lse [B, H, J * 64] fp32 natural
        log, -inf where a row has no key); padding slots hold whatever cuDNN leaves there.
    """
    return exact_in_chunks(q, k, v, plan, tiled_pack, exact, HEADS_PER_CALL)


def block_sparse_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                       tiled_pack: Callable, add_tail: Callable, exact: Callable = exact_keys
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention of q, k, v [B, H, S, D] under `plan`: exact keys on cuDNN, the tail
    and the store to model order on the Triton kernel.

    Args:
        q, k, v: one fp16/bf16 dtype on an enabled GPU (`family.REQUIRES`), head_dim in
            HEAD_DIMS, any strides.
        plan: a plan with block size 64 and the routing groups (`sparse_span`).
        tiled_pack, add_tail: the Triton family's helpers of those names (`registry.helper`).
        exact: one head chunk's exact keys (`exact_attention_cudnn`).
    Returns:
        (out [B, H, S, D] in q's dtype and model order, lse [B, H, S] fp32 natural log), as
        `block_sparse_triton`.
    """
    check_call(q, plan)
    return add_tail(q, plan, exact_attention_cudnn(q, k, v, plan, tiled_pack, exact))
