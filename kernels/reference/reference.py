"""Pure-torch reference of block-sparse attention with tail summaries: the oracle.

Straightforward and vectorised rather than fast: it packs Q/K/V into tiled order, builds the
token-level mask from the block plan, appends the summary columns, runs one softmax per row
(normalised once over exact keys and summaries) and scatters rows back to the model's order.
Memory is bounded by processing query blocks in chunks. Computes in float64 for float64 inputs,
float32 otherwise; returns the input dtype and an fp32/fp64 natural-log LSE.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ...errors import SparseAttentionError
from ..arch import EightBitConfig, eight_bit_config
from ..eight_bit import P_SCALE, PRECISIONS
from ..plan import EMPTY_ROW_LSE, BlockSparsePlan, BlockSummaries, QuerySummaries, pack, unpack
from .quantise import quantise_blocks_torch, quantise_p

CHUNK_ELEMENTS = 1 << 25  # logits per chunk
LOG2E = 1.4426950408889634
LN2 = math.log(2.0)


def block_sparse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan, *,
                           eight_bit: EightBitConfig | None = None, query_blocks: Sequence[int] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q, k, v [B, H, S, D] under `plan`, the oracle every fast path is tested against
    (and the `torch` backend's kernel: differentiable, any device and dtype).

    Args:
        q, k, v: model order, one dtype and device.
        plan: the plan (its tail, if any, joins the same softmax); logits are scaled by head_dim ** -0.5.
        eight_bit: the selected key blocks in the 8-bit arithmetic of the Triton kernel with this
            config (`quantise.quantise_blocks_torch`, P quantised per key tile of `block_n` rows,
            `triton/attention.py` `_quantised_keys`); the dense prefix and the tail as without it.
        query_blocks: compute only these query blocks (ascending tiled block indices; rows of the
            others get zeros and EMPTY_ROW_LSE): the check of a kernel on sampled rows. None: all.
    Returns:
        (out [B, H, S, D] in q's dtype, lse [B, H, S] natural log in the compute dtype; a row with
        nothing allowed gets zeros and EMPTY_ROW_LSE).
    """
    B, H, S, D = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = D ** -0.5
    bs, J, tail = plan.block_size, plan.num_blocks, plan.tail
    qt = pack(q, plan.q_perm).to(acc)
    kt = pack(k, plan.k_perm).to(acc)
    vt = pack(v, plan.k_perm).to(acc)
    key_valid = (torch.arange(bs, device=q.device).view(1, bs) < plan.block_len.view(J, 1)).reshape(-1)
    out_t = torch.zeros_like(qt) if query_blocks is not None else torch.empty_like(qt)
    lse_t = torch.full((B, H, J * bs), EMPTY_ROW_LSE, dtype=acc, device=q.device)
    quantised = None if eight_bit is None else _QuantisedKeys(q, k, v, plan, eight_bit, acc)
    step = max(1, CHUNK_ELEMENTS // max(1, B * H * bs * J * bs) // (1 if eight_bit is None else 4))
    for i0, i1 in _chunks(range(J) if query_blocks is None else query_blocks, step):
        rows = slice(i0 * bs, i1 * bs)
        qc = qt[:, :, rows]
        logits = torch.matmul(qc, kt.transpose(-1, -2)) * scale
        exact = plan.allowed_mask(slice(i0, i1)) if quantised is None else _prefix_mask(plan, i0, i1)
        mask = exact.repeat_interleave(bs, 2).repeat_interleave(bs, 3) & key_valid
        cols, vals = [logits.masked_fill(~mask, float("-inf"))], [vt]
        if quantised is not None:
            logit, val = quantised.terms(i0, i1, key_valid)
            cols.append(logit)
            vals.append(val)
        if isinstance(tail, QuerySummaries):
            tl = torch.matmul(qc, tail.key.to(acc).transpose(-1, -2)) * scale + tail.bias.to(acc).unsqueeze(2)
            cols.append(tl.masked_fill(~plan.summary_mask(slice(i0, i1)).repeat_interleave(bs, 2), float("-inf")))
            vals.append(tail.value.to(acc))
        if isinstance(tail, BlockSummaries):
            cols.append(tail.logit[:, :, i0:i1].to(acc).repeat_interleave(bs, 2).unsqueeze(-1))
            vals.append(None)
        scores = torch.cat(cols, dim=-1)
        m = scores.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m)
        l = torch.zeros_like(m)
        num = torch.zeros_like(qc)
        col = 0
        for c, val in zip(cols, vals):
            pc = p[..., col:col + c.shape[-1]]
            if val is None:  # one shared summary value per query block
                num = num + pc * tail.value[:, :, i0:i1].to(acc).repeat_interleave(bs, 2)
                l = l + pc
            elif isinstance(val, tuple):  # 8-bit key tiles: weights of P's codes and of the sums of p'
                codes, sums, v_deq = val
                num = num + torch.matmul((codes * pc.unsqueeze(-1)).flatten(-2), v_deq)
                l = l + (pc * sums).sum(-1, keepdim=True)
            else:
                num = num + torch.matmul(pc, val)
                l = l + pc.sum(-1, keepdim=True)
            col += c.shape[-1]
        empty = l == 0
        out_t[:, :, rows] = torch.where(empty, torch.zeros_like(num), num / torch.where(empty, torch.ones_like(l), l))
        lse = m + torch.log(torch.where(empty, torch.ones_like(l), l))
        lse_t[:, :, rows] = torch.where(empty, torch.full_like(lse, EMPTY_ROW_LSE), lse).squeeze(-1)
    out = unpack(out_t, plan.q_perm, S).to(q.dtype)
    lse = unpack(lse_t.unsqueeze(-1), plan.q_perm, S).squeeze(-1)
    return out, lse


def _chunks(blocks: Sequence[int], step: int) -> list[tuple[int, int]]:
    """[i0, i1) spans of at most `step` consecutive blocks covering the ascending `blocks`."""
    spans: list[tuple[int, int]] = []
    for b in blocks:
        if spans and spans[-1][1] == b and b - spans[-1][0] < step:
            spans[-1] = (spans[-1][0], b + 1)
        else:
            spans.append((b, b + 1))
    return spans


def _prefix_mask(plan: BlockSparsePlan, i0: int, i1: int) -> torch.Tensor:
    """bool [1, 1, i1 - i0, J]: the dense prefix of query blocks i0:i1."""
    cols = torch.arange(plan.num_blocks, device=plan.dense_hi.device)
    return (cols.view(1, -1) < plan.dense_hi[i0:i1].view(-1, 1)).view(1, 1, i1 - i0, -1)


class _QuantisedKeys:
    """The selected key blocks of a call in the 8-bit kernel's arithmetic, query blocks at a time."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                 config: EightBitConfig, acc: torch.dtype) -> None:
        self.plan, self.pv, self.acc = plan, config.pv, acc
        self.block_n = min(config.block_n, plan.block_size)
        self.codes = quantise_blocks_torch(q, k, v, plan, config.pv)
        self.k_codes = self.codes.k_codes.to(torch.float64)  # integer products and sums stay exact
        self.v_deq = self.codes.v_codes.float().transpose(-1, -2).to(acc) * self.codes.v_scale.unsqueeze(2).to(acc)
        # the kernel's fp32 scale argument
        self.qk_scale = torch.tensor(q.shape[-1] ** -0.5 * LOG2E, dtype=torch.float32, device=q.device)
        self.scale = q.shape[-1] ** -0.5

    def terms(self, i0: int, i1: int, key_valid: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """(natural-log weight of every key tile [B, H, rows, tiles], (P's codes / their scale
        [B, H, rows, tiles, block_n], sums of p' [B, H, rows, tiles], dequantised V [B, H, L, D]))
        for query blocks i0:i1."""
        plan, c, bs, bn = self.plan, self.codes, self.plan.block_size, self.block_n
        rows = slice(i0 * bs, i1 * bs)
        ints = torch.matmul(c.q_codes[:, :, rows].to(torch.float64), self.k_codes.transpose(-1, -2)).float()
        per_block = (c.q_scale[:, :, i0:i1] * self.qk_scale).unsqueeze(-1) * c.k_scale.unsqueeze(2)
        s = ints * per_block.repeat_interleave(bs, 2).repeat_interleave(bs, 3)
        picked = plan.selected_mask(slice(i0, i1)).repeat_interleave(bs, 2).repeat_interleave(bs, 3) & key_valid
        s = s.masked_fill(~picked, float("-inf")).unflatten(-1, (-1, bn))
        top = s.amax(-1)
        if self.pv == "fp8":  # relative to the running max of the tile maxima (the kernel's `ref`)
            top = torch.cummax(top.clamp(min=-1.0e30), -1).values
            p = torch.exp2(s - (top - 8.0).unsqueeze(-1))  # 256 exp2(s - ref)
        else:  # relative to the tile's own max
            p = torch.exp2(s - torch.where(top == float("-inf"), 0.0, top).unsqueeze(-1))
        scale = P_SCALE[self.pv] if self.pv == "fp8" else 1.0  # what p was multiplied by
        codes = (quantise_p(p / scale, self.pv) / P_SCALE[self.pv]).to(self.acc)
        logit = top.to(self.acc) * LN2 + (c.q_shift[:, :, rows].to(self.acc) * self.scale).unsqueeze(-1)
        return logit, (codes, (p.sum(-1) / scale).to(self.acc), self.v_deq)


class ReferenceAttention:
    """The `torch` row of the attention: `block_sparse_reference`."""

    def attend_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                      precision: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, S, D] in q's dtype, lse [B, H, S]) of q, k, v under `plan`; with "8-bit", the
        arithmetic of the Triton kernel's 8-bit loop for this device (`arch.eight_bit_config`)."""
        if precision not in PRECISIONS:
            raise SparseAttentionError(f"kernel='torch': precision={precision!r} is not allowed: expected one of "
                             f"{', '.join(map(repr, PRECISIONS))}")
        eight_bit = eight_bit_config(q.shape[-1], plan.block_size, q.device) if precision == "8-bit" else None
        return block_sparse_reference(q, k, v, plan, eight_bit=eight_bit)
