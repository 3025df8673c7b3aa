"""Pure-torch references of the planner's kernels: the `torch` row of every planner operation.

Each function has the signature of its Triton twin (`block_stats.py`, `block_scores.py`,
`block_select.py`, `block_mass.py`), so the table (`kernels/registry.py`) can give a stage either one.
They run on any device and dtype, compute in float64 for float64 inputs and float32 otherwise,
and work a few heads at a time so gathered copies stay a small fraction of Q/K/V.
"""
from __future__ import annotations

import torch

from ..plan import RoutingGroup, pack, perm_heads

HEADS_PER_PASS = 8


def accum_dtype(x: torch.Tensor) -> torch.dtype:
    """Dtype the planner reduces x in: float64 for float64 inputs (the reference), else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def block_rows(x: torch.Tensor, perm: torch.Tensor, num_blocks: int, block_size: int, h0: int, h1: int
               ) -> torch.Tensor:
    """Heads h0:h1 of x gathered into blocks: [B, h, J, block_size, D] in the accumulation dtype."""
    rows = pack(x[:, h0:h1], perm_heads(perm, h0, h1)).to(accum_dtype(x))
    return rows.view(x.shape[0], h1 - h0, num_blocks, block_size, x.shape[-1])


def block_sums_torch(x: torch.Tensor, perm: torch.Tensor, block_len: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, H, J, D] sums (accumulation dtype) of every block's rows of x [B, H, S, D]; padding slots add nothing."""
    B, H, _, D = x.shape
    J = block_len.numel()
    out = x.new_empty(B, H, J, D, dtype=accum_dtype(x))
    for h0 in range(0, H, HEADS_PER_PASS):
        h1 = min(H, h0 + HEADS_PER_PASS)
        rows = pack(x[:, h0:h1], perm_heads(perm, h0, h1))
        out[:, h0:h1] = rows.view(B, h1 - h0, J, block_size, D).sum(3, dtype=accum_dtype(x))
    return out


def _block_means(x: torch.Tensor, perm: torch.Tensor, block_len: torch.Tensor, block_size: int) -> torch.Tensor:
    n = block_len.to(accum_dtype(x)).view(1, 1, -1, 1)
    return (block_sums_torch(x, perm, block_len, block_size) / n).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def block_summaries_torch(k: torch.Tensor, v: torch.Tensor, perm: torch.Tensor, block_len: torch.Tensor,
                          block_size: int, anchor: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tail summaries of every key block (key [B,H,J,D] k.dtype, value [B,H,J,D] v.dtype, bias
    [B,H,J] accumulation dtype), as `block_stats.block_summaries_triton`.

    Without `anchor`: the block's mean key and value (non-finite means 0) and bias log(n). With
    `anchor` [B, H, D]: weights softmax(anchor . k / sqrt(D)) over the block's rows with a finite
    key, key sum w k (stored in k's dtype), value sum w v, bias log Z - anchor . key / sqrt(D)
    against the stored key (-inf for a block without a finite key)."""
    B, H, _, D = k.shape
    J, acc = block_len.numel(), accum_dtype(k)
    if anchor is None:
        k_mean = _block_means(k, perm, block_len, block_size)
        v_mean = _block_means(v, perm, block_len, block_size)
        bias = torch.log(block_len.to(acc)).expand(B, H, J).contiguous()
        return k_mean.to(k.dtype), v_mean.to(v.dtype), bias
    scale = D ** -0.5
    valid = torch.arange(block_size, device=k.device).view(1, block_size) < block_len.view(J, 1)
    key = k.new_empty(B, H, J, D)
    value = v.new_empty(B, H, J, D)
    bias = torch.empty(B, H, J, dtype=acc, device=k.device)
    for h0 in range(0, H, HEADS_PER_PASS):
        h1 = min(H, h0 + HEADS_PER_PASS)
        a = anchor[:, h0:h1].to(acc)
        kk = block_rows(k, perm, J, block_size, h0, h1)
        good = valid & torch.isfinite(kk).all(-1)  # a non-finite key row is left out of its block's summary
        kk = kk.masked_fill(~good.unsqueeze(-1), 0.0)
        logits = torch.einsum("bhjsd,bhd->bhjs", kk, a) * scale
        logits = logits.masked_fill(~good, float("-inf"))
        lse = torch.logsumexp(logits, -1)  # -inf for a block without a finite key: its bias drops it
        w = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
        stored = torch.einsum("bhjs,bhjsd->bhjd", w, kk).to(k.dtype)
        key[:, h0:h1] = stored
        vv = block_rows(v, perm, J, block_size, h0, h1).masked_fill(~good.unsqueeze(-1), 0.0)
        value[:, h0:h1] = torch.einsum("bhjs,bhjsd->bhjd", w, vv).to(v.dtype)
        bias[:, h0:h1] = lse - torch.einsum("bhjd,bhd->bhj", stored.to(acc), a) * scale
    return key, value, bias


def pooled_scores_torch(q_mean: torch.Tensor, k_mean: torch.Tensor, rows: tuple[int, int] | None = None,
                        cols: tuple[int, int] | None = None) -> torch.Tensor:
    """Window rows x cols (default: all) of q_mean k_mean^T / sqrt(D), in the means' dtype."""
    J = q_mean.shape[2]
    (i0, i1), (c0, c1) = rows or (0, J), cols or (0, J)
    return torch.matmul(q_mean[:, :, i0:i1], k_mean[:, :, c0:c1].transpose(-1, -2)) * (q_mean.shape[-1] ** -0.5)


def quantised_scores_torch(q_codes: torch.Tensor, q_scale: torch.Tensor, k_codes: torch.Tensor,
                           k_scale: torch.Tensor, rows: tuple[int, int] | None = None,
                           cols: tuple[int, int] | None = None) -> torch.Tensor:
    """Window of (q_codes k_codes^T * q_scale) * k_scale with the codes as fp32, so int8 sums are
    exact and match the kernel's int32 sums."""
    J = q_codes.shape[2]
    (i0, i1), (c0, c1) = rows or (0, J), cols or (0, J)
    acc = torch.matmul(q_codes[:, :, i0:i1].float(), k_codes[:, :, c0:c1].float().transpose(-1, -2))
    return acc * q_scale[:, :, i0:i1].unsqueeze(-1) * k_scale[:, :, c0:c1].unsqueeze(-2)


def topk_blocks(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices of the `budget` largest scores along the last dim; ties -> lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :budget]


def select_blocks_torch(scores: torch.Tensor, dense_hi: torch.Tensor, groups: tuple[RoutingGroup, ...],
                        out: torch.Tensor | None = None, i0: int = 0, c0: int = 0) -> torch.Tensor:
    """Per-group stable-sort TopK of a score window (rows of query blocks i0.., columns of key
    blocks c0..): int32 [B, H, J, R] ascending, -1 rows for dense query blocks, written into the
    window's rows of `out` when given (as `block_select.select_blocks_triton`)."""
    J, n = dense_hi.shape[0], scores.shape[2]
    picks = [topk_blocks(scores[..., lo - c0:hi - c0], budget) + lo for lo, hi, budget in groups]
    idx = torch.sort(torch.cat(picks, dim=-1), dim=-1).values.to(torch.int32)
    idx = torch.where((dense_hi[i0:i0 + n] < J).view(1, 1, -1, 1), idx, torch.full_like(idx, -1))
    if out is None:
        return idx
    out[:, :, i0:i0 + n] = idx
    return out


def block_log_mass_torch(probes: torch.Tensor, k: torch.Tensor, perm: torch.Tensor, block_size: int) -> torch.Tensor:
    """log sum_i exp(q . k_i / sqrt(D)) of every probe q [G, P, D] over the rows of every key block
    of k [G, S, D] listed by perm [Gp, n * block_size] (-1 pads): [G, P, n], accumulation dtype."""
    G, P, D = probes.shape
    acc = accum_dtype(k)
    ids = perm.long()
    out = torch.empty(G, P, ids.shape[-1] // block_size, dtype=acc, device=k.device)
    for g0 in range(0, G, HEADS_PER_PASS):
        g1 = min(G, g0 + HEADS_PER_PASS)
        logits = probes[g0:g1].to(acc) @ k[g0:g1].to(acc).transpose(1, 2) * D ** -0.5
        rows = (ids if ids.shape[0] == 1 else ids[g0:g1]).unsqueeze(1)
        cols = torch.gather(logits, 2, rows.clamp(min=0).expand(g1 - g0, P, -1))
        cols = cols.masked_fill(rows < 0, float("-inf"))
        out[g0:g1] = cols.view(g1 - g0, P, -1, block_size).logsumexp(-1)
    return out


def top_share_torch(log_mass: torch.Tensor, budget: int) -> torch.Tensor:
    """Share of every row's mass in its `budget` heaviest entries: log-masses [..., n] -> [...]."""
    total = log_mass.logsumexp(-1, keepdim=True)
    return (log_mass.topk(budget, -1).values - total).exp().sum(-1)
