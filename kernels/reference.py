"""Pure-torch reference of block-sparse attention with tail summaries: the oracle.

Straightforward and vectorised rather than fast: it packs Q/K/V into tiled order, builds the
token-level mask from the block plan, appends the summary columns, runs one softmax per row
(normalised once over exact keys and summaries) and scatters rows back to the model's order.
Memory is bounded by processing query blocks in chunks. Computes in float64 for float64 inputs,
float32 otherwise; returns the input dtype and an fp32/fp64 natural-log LSE.
"""
from __future__ import annotations

import torch

from .plan import EMPTY_ROW_LSE, BlockSparsePlan, BlockSummaries, QuerySummaries, pack, unpack

CHUNK_ELEMENTS = 1 << 25  # logits per chunk


def block_sparse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q, k, v [B, H, S, D] under `plan`, the oracle every fast path is tested against
    (and the `torch` backend's kernel: differentiable, any device and dtype).

    Args:
        q, k, v: model order, one dtype and device.
        plan: the plan (its tail, if any, joins the same softmax); logits are scaled by head_dim ** -0.5.
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
    out_t = torch.empty_like(qt)
    lse_t = torch.empty(B, H, J * bs, dtype=acc, device=q.device)
    step = max(1, CHUNK_ELEMENTS // max(1, B * H * bs * J * bs))
    for i0 in range(0, J, step):
        i1 = min(J, i0 + step)
        rows = slice(i0 * bs, i1 * bs)
        qc = qt[:, :, rows]
        logits = torch.matmul(qc, kt.transpose(-1, -2)) * scale
        mask = plan.allowed_mask(slice(i0, i1)).repeat_interleave(bs, 2).repeat_interleave(bs, 3) & key_valid
        cols, vals = [logits.masked_fill(~mask, float("-inf"))], [vt]
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
        l = p.sum(-1, keepdim=True)
        num = torch.zeros_like(qc)
        col = 0
        for c, val in zip(cols, vals):
            pc = p[..., col:col + c.shape[-1]]
            if val is None:  # one shared summary value per query block
                num = num + pc * tail.value[:, :, i0:i1].to(acc).repeat_interleave(bs, 2)
            else:
                num = num + torch.matmul(pc, val)
            col += c.shape[-1]
        empty = l == 0
        out_t[:, :, rows] = torch.where(empty, torch.zeros_like(num), num / torch.where(empty, torch.ones_like(l), l))
        lse = m + torch.log(torch.where(empty, torch.ones_like(l), l))
        lse_t[:, :, rows] = torch.where(empty, torch.full_like(lse, EMPTY_ROW_LSE), lse).squeeze(-1)
    out = unpack(out_t, plan.q_perm, S).to(q.dtype)
    lse = unpack(lse_t.unsqueeze(-1), plan.q_perm, S).squeeze(-1)
    return out, lse


class ReferenceAttention:
    """The `torch` row of the attention: `block_sparse_reference`."""

    def attend_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, S, D] in q's dtype, lse [B, H, S]) of q, k, v under `plan`."""
        return block_sparse_reference(q, k, v, plan)
