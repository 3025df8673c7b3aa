"""Head-parallel (Ulysses) sparse attention: each rank runs the engine on its own group of heads.

Ulysses sequence parallelism shards the rows of the sequence over P ranks. Around attention, an
all-to-all gives every rank all rows of H/P heads, and a second one gives the rows back. The
planner treats every head on its own (tiling, pooled scores, TopK and summaries read that
head's q and k only), so a rank's plan for its heads is the single-device plan of those heads,
and no collective is needed beyond the two all-to-alls.

Ring attention (ring degree > 1) is refused: there the sequence stays sharded at attention time,
so block selection would need the pooled keys of every rank and the partial outputs a
log-sum-exp merge, which this engine does not implement.
"""
from __future__ import annotations

import torch

from ..errors import SparseAttentionError
from .attention import sparse_attention
from .config import SparseConfig
from .layout import SequenceLayout


def degrees_dividing(heads: int) -> list[int]:
    """The Ulysses degrees a model with `heads` attention heads allows (its divisors)."""
    return [d for d in range(1, heads + 1) if heads % d == 0]


def check_sequence_parallel(heads: int, ulysses_degree: int, ring_degree: int = 1) -> None:
    """Raise ValueError unless sparse attention can run under this sequence-parallel split.

    Args:
        heads: attention heads of the model (56 for MiniMax-H3).
        ulysses_degree: ranks that split the heads after the all-to-all.
        ring_degree: ranks that keep the sequence sharded through attention (ring attention).
    """
    if not isinstance(ring_degree, int) or ring_degree != 1:
        raise SparseAttentionError(
            f"ring_degree={ring_degree!r} is not supported by adaptive sparse attention: ring attention keeps the "
            "sequence sharded through attention, so block selection would need pooled keys from every rank and "
            "a log-sum-exp merge of partial outputs, which this engine does not do. Use ring_degree=1 and put "
            "the GPUs into ulysses_degree.")
    if not isinstance(ulysses_degree, int) or ulysses_degree < 1 or heads % ulysses_degree:
        raise SparseAttentionError(
            f"ulysses_degree={ulysses_degree!r} is not supported: it must divide the model's {heads} attention "
            f"heads, one of {', '.join(map(str, degrees_dividing(heads)))}")


def padded_rows(rows: int, degree: int) -> int:
    """Rows of the sequence after padding it to a multiple of `degree` (as sequence parallelism does)."""
    return -(-rows // degree) * degree


def local_heads_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                          config: SparseConfig | None = None, *, return_info: bool = False):
    """Sparse attention of one rank's heads over all rows, in the sequence-major layout of xFuser.

    Args:
        q, k, v: [B, S, h, D] after the Ulysses all-to-all (all rows, this rank's h heads), in the
            model's token order; S >= layout.total. Rows from layout.total on are the padding that
            makes S divisible by the degree: they are neither keys nor queries, and their output
            rows are zero, so the real rows get exactly the single-device result.
        layout, config: as for `sparse_attention`.
        return_info: also return the `SparseInfo` of these heads.

    Returns:
        The output [B, S, h, D] in q's dtype (and the info with `return_info`).
    """
    rows = layout.total
    if q.dim() != 4 or q.shape[1] < rows:
        raise SparseAttentionError(f"local_heads_attention: q must be [B, S, h, D] with S >= the layout's {rows} rows, "
                         f"got shape {tuple(q.shape)}")
    q_, k_, v_ = (t[:, :rows].transpose(1, 2) for t in (q, k, v))
    result = sparse_attention(q_, k_, v_, layout, config, return_info=return_info)
    out, info = result if return_info else (result, None)
    full = q.new_zeros(q.shape)
    full[:, :rows] = out.transpose(1, 2)
    return (full, info) if return_info else full


def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-to-all [B, S/P, H, D] (this rank's rows, all heads) -> [B, S, H/P, D] (all rows, its heads).

    Rank r receives heads [r H/P, (r + 1) H/P) and the rows in rank order.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def heads_to_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """The inverse all-to-all: [B, S, H/P, D] -> [B, S/P, H, D]."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    b, rows, h, d = x.shape
    send = x.reshape(b, world, rows // world, h, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, rows // world, world * h, d)


def sequence_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                                config: SparseConfig | None = None, group=None, *, return_info: bool = False):
    """Ulysses sequence-parallel sparse attention over a torch.distributed process group.

    Args:
        q, k, v: this rank's rows [B, S/P, H, D] of the sequence padded to S = `padded_rows(layout.total, P)`;
            rank r holds rows [r S/P, (r + 1) S/P).
        layout, config: as for `sparse_attention` (the whole sequence's layout).
        group: the Ulysses process group (default: the world).
        return_info: also return the `SparseInfo` of this rank's heads.

    Returns:
        This rank's output rows [B, S/P, H, D] (and the info of its heads with `return_info`).
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    check_sequence_parallel(q.shape[2], world)
    if q.shape[1] * world != padded_rows(layout.total, world):
        raise SparseAttentionError(f"sequence_parallel_attention: {q.shape[1]} rows per rank x {world} ranks do not hold the "
                         f"layout's {layout.total} rows padded to {padded_rows(layout.total, world)}")
    q_, k_, v_ = (seq_to_heads(t, group) for t in (q, k, v))
    result = local_heads_attention(q_, k_, v_, layout, config, return_info=return_info)
    out, info = result if return_info else (result, None)
    out = heads_to_seq(out, group)
    return (out, info) if return_info else out

