"""The QKV producer's epilogue in torch: q/k RMSNorm and split-half RoPE, q, k, v written head-major.

H3 normalises each head of q and k (RMSNorm over D), then rotates pair (i, i + rot_dim/2) of the first
`rot_dim` dims by a [1, n, 1, rot_dim/2, 2, 2] table of [[cos, -sin], [sin, cos]]. The arithmetic
mirrors comfy-kitchen's `rms_rope_split_half_`, the kernel H3 itself calls: the norm in x's dtype, the
rotation in the table's dtype, the result in x's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_rope_split_half(x: torch.Tensor, table: torch.Tensor | None, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of x [..., n, heads, D], then split-half RoPE by `table` (None: the norm only)."""
    y = F.rms_norm(x, (x.shape[-1],), weight=scale.to(x.dtype), eps=eps)
    if table is None:
        return y
    half = table.shape[-3]
    rot_dim = 2 * half
    a = y[..., :half].to(table.dtype)
    b = y[..., half:rot_dim].to(table.dtype)
    first = table[..., 0, 0] * a + table[..., 0, 1] * b
    second = table[..., 1, 0] * a + table[..., 1, 1] * b
    return torch.cat((first.to(x.dtype), second.to(x.dtype), y[..., rot_dim:]), dim=-1)


def norm_rope_torch(chunk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                    table: torch.Tensor | None, q_scale: torch.Tensor, k_scale: torch.Tensor, eps: float) -> None:
    """Write rows [start, start + n) of q, k, v from one projected chunk.

    Args:
        chunk: [n, 3 * g * D], the fused projection's q, k, v columns of g heads (any strides).
        q, k, v: [1, g, S, D] outputs, written in place at rows [start, start + n).
        start: the chunk's first row in the sequence.
        table: the chunk's rotation table [1, n, 1, rot_dim/2, 2, 2], or None for no RoPE.
        q_scale, k_scale: the RMSNorm weights [D]; eps: its epsilon.
    """
    n, g, D = chunk.shape[0], q.shape[1], q.shape[-1]
    qc, kc, vc = (t.reshape(1, n, g, D) for t in chunk.split(g * D, dim=-1))
    q[0, :, start:start + n] = rms_rope_split_half(qc, table, q_scale, eps)[0].transpose(0, 1)
    k[0, :, start:start + n] = rms_rope_split_half(kc, table, k_scale, eps)[0].transpose(0, 1)
    v[0, :, start:start + n] = vc[0].transpose(0, 1)
