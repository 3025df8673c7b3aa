"""Quality metrics of sparse attention against dense attention, per row group.

Row groups are the layout's context segment kinds (`text`, `audio`, ...), `video` (the target
video) and `ref_video`. Metrics:

- attention-mass recall: for sampled query rows, the share of the dense softmax mass that falls
  on the keys the plan computes exactly (context prefix + selected blocks); computed exactly from
  the full logit rows of those queries, so it needs no dense output.
- relative L2 error ||o - o_dense|| / ||o_dense|| and mean row cosine of the output, on every row.
- log-mass error of the tail summaries: for sampled rows, (log of the summary mass the kernel
  uses) - (log of the true mass of the keys the summaries stand for), in natural-log units.
Context rows must come out exact (their recall is 1 and their error is rounding only).
"""
from __future__ import annotations

import math

import torch

from ..backend.layout import CONTEXT, REFERENCE_VIDEO, TARGET_VIDEO, SequenceLayout
from ..kernels.plan import BlockSparsePlan, QuerySummaries

LOGIT_BYTES = 1 << 29  # fp32 logits held at once while scoring sampled rows
GROUP_OF_REGION = {TARGET_VIDEO: "video", REFERENCE_VIDEO: "ref_video"}


def row_groups(layout: SequenceLayout) -> dict[str, torch.Tensor]:
    """Model-order rows (int64) of every group: context kinds by name, then `ref_video`, `video`."""
    parts: dict[str, list[torch.Tensor]] = {}
    for seg in layout.segments:
        name = seg.kind if seg.region == CONTEXT else GROUP_OF_REGION[seg.region]
        parts.setdefault(name, []).append(torch.arange(seg.start, seg.stop))
    return {name: torch.cat(rows) for name, rows in parts.items()}


def sample_rows(layout: SequenceLayout, per_group: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Up to `per_group` rows of every group, drawn without replacement, sorted; deterministic."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, rows in row_groups(layout).items():
        pick = torch.randperm(rows.numel(), generator=gen)[:per_group]
        out[name] = rows[pick].sort().values
    return out


def output_errors(out: torch.Tensor, ref: torch.Tensor, layout: SequenceLayout) -> dict[str, dict[str, float]]:
    """Relative L2 and mean cosine of out vs ref [B, H, S, D] on every row group."""
    result = {}
    for name, rows in row_groups(layout).items():
        rows = rows.to(out.device)
        sq_diff = sq_ref = cos_sum = 0.0
        for h in range(out.shape[1]):  # one head at a time keeps the float64 copies small
            a, b = out[:, h].index_select(1, rows).double(), ref[:, h].index_select(1, rows).double()
            sq_diff += float((a - b).pow(2).sum())
            sq_ref += float(b.pow(2).sum())
            cos_sum += float(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-300)).sum())
        count = out.shape[0] * out.shape[1] * rows.numel()
        result[name] = {"rel_l2": math.sqrt(sq_diff / max(sq_ref, 1e-300)), "cosine": cos_sum / count}
    return result


def block_of_rows(perm: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """Inverse of a tiling permutation: block index [Bp, Hp, seq_len] (int64) of every model row."""
    Bp, Hp, L = perm.shape
    slots = torch.arange(L, device=perm.device).expand(Bp, Hp, L) // block_size
    idx = perm.long()
    target = torch.where(idx >= 0, idx, torch.full_like(idx, seq_len))
    out = torch.full((Bp, Hp, seq_len + 1), -1, dtype=torch.long, device=perm.device)
    out.scatter_(2, target, slots)
    return out[..., :seq_len]


def _head_chunk(n_rows: int, seq_len: int) -> int:
    return max(1, LOGIT_BYTES // max(1, 4 * n_rows * seq_len * 3))


def plan_mass_metrics(q: torch.Tensor, k: torch.Tensor, plan: BlockSparsePlan, rows: torch.Tensor,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For query rows `rows` (model order, int64): attention-mass recall [B, H, n] of the exactly
    computed keys, and the tail log-mass error [B, H, n] (None without summaries; NaN where a
    row has no summarised keys)."""
    B, H, S, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = rows.to(q.device)
    n, J = rows.numel(), plan.num_blocks
    q_block = block_of_rows(plan.q_perm, plan.block_size, S)
    k_block = block_of_rows(plan.k_perm, plan.block_size, S)
    allowed, summary = plan.allowed_mask(), plan.summary_mask()
    tail = plan.tail
    has_tail = tail is not None
    recall = torch.empty(B, H, n, dtype=acc, device=q.device)
    err = torch.full((B, H, n), float("nan"), dtype=acc, device=q.device) if has_tail else None
    step = _head_chunk(n, S)
    for b in range(B):
        for h0 in range(0, H, step):
            h1 = min(H, h0 + step)
            hs = torch.arange(h0, h1, device=q.device)
            qb = q_block[min(b, q_block.shape[0] - 1)].index_select(0, hs.clamp(max=q_block.shape[1] - 1))[:, rows]
            kb = k_block[min(b, k_block.shape[0] - 1)].index_select(0, hs.clamp(max=k_block.shape[1] - 1))
            logits = torch.matmul(q[b, h0:h1, rows].to(acc), k[b, h0:h1].to(acc).transpose(-1, -2)) * scale
            lse = torch.logsumexp(logits, -1, keepdim=True)
            row_allowed = torch.gather(allowed[b, h0:h1], 1, qb.unsqueeze(-1).expand(-1, -1, J))  # [h, n, J]
            key_mask = torch.gather(row_allowed, 2, kb.unsqueeze(1).expand(-1, n, -1))  # [h, n, S]
            p = torch.exp(logits - lse)
            recall[b, h0:h1] = (p * key_mask).sum(-1)
            if err is None:
                continue
            row_summary = torch.gather(summary[b, h0:h1], 1, qb.unsqueeze(-1).expand(-1, -1, J))
            summarised = torch.gather(row_summary, 2, kb.unsqueeze(1).expand(-1, n, -1))
            true = torch.logsumexp(logits.masked_fill(~summarised, float("-inf")), -1)
            if isinstance(tail, QuerySummaries):
                est_logits = torch.matmul(q[b, h0:h1, rows].to(acc), tail.key[b, h0:h1].to(acc).transpose(-1, -2)) * scale
                est_logits = est_logits + tail.bias[b, h0:h1].to(acc).unsqueeze(1)
                est = torch.logsumexp(est_logits.masked_fill(~row_summary, float("-inf")), -1)
            else:
                est = torch.gather(tail.logit[b, h0:h1].to(acc), 1, qb)
            err[b, h0:h1] = torch.where(torch.isfinite(true), est - true, torch.full_like(true, float("nan")))
    return recall, err


def quality_report(q: torch.Tensor, k: torch.Tensor, layout: SequenceLayout, out: torch.Tensor,
                   ref: torch.Tensor, plan: BlockSparsePlan | None, rows: dict[str, torch.Tensor]
                   ) -> dict[str, dict[str, float | None]]:
    """Every metric per row group: rel_l2, cosine, recall (mean over heads and sampled rows),
    recall_min_head (the worst head's mean), logmass_err (mean |error|), logmass_bias (mean error).
    Plan-based entries are None when `plan` is None (e.g. dense or an outside kernel)."""
    report: dict[str, dict[str, float | None]] = {g: dict(v) for g, v in output_errors(out, ref, layout).items()}
    for group, sampled in rows.items():
        entry = report[group]
        entry.update(recall=None, recall_min_head=None, logmass_err=None, logmass_bias=None)
        if plan is None or sampled.numel() == 0:
            continue
        recall, err = plan_mass_metrics(q, k, plan, sampled)
        entry["recall"] = float(recall.mean())
        entry["recall_min_head"] = float(recall.mean((0, 2)).min())
        if err is not None and bool(torch.isfinite(err).any()):
            finite = err[torch.isfinite(err)]
            entry["logmass_err"] = float(finite.abs().mean())
            entry["logmass_bias"] = float(finite.mean())
    return report
