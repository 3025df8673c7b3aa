"""The exact keys on a kernel that reads key blocks as contiguous rows (cuDNN-frontend's, the sm90 kernel).

Such a kernel takes Q, K and V in tiled order ([B, h, J * block_size, D], `plan.pack`'s order), so a call
packs them a few heads at a time (the Triton family's fused gather, handed in as `tiled_pack`), which bounds
the extra memory to those heads' copies, and runs the kernel on each chunk. What comes back is each row's
attention over its exact keys, normalised, with its log-sum-exp, in tiled order: the tail joins it after
(the Triton family's `add_tail`), in the same softmax.
"""
from __future__ import annotations

from typing import Callable

import torch

from .plan import BlockSparsePlan, perm_heads

ExactKeys = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, BlockSparsePlan, tuple[int, int]],
                     tuple[torch.Tensor, torch.Tensor]]


def exact_in_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan, tiled_pack: Callable,
                    exact: ExactKeys, heads_per_call: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact keys' attention of every query row, in tiled order, `heads_per_call` heads at a time.

    Args:
        q, k, v: [B, H, S, D] in model order.
        plan: the plan.
        tiled_pack: (q, k, v, q_perm, k_perm) -> contiguous packed (qp, kp, vp) of those heads.
        exact: (qp, kp, vp, plan, (h0, h1)) -> (out, lse) of one packed head chunk.
        heads_per_call: heads packed at once.
    Returns:
        (out [B, H, J * block_size, D] normalised over the exact keys, lse [B, H, J * block_size] fp32
        natural log, -inf where a row has no key); padding slots hold whatever the kernel leaves there.
    """
    H = q.shape[1]
    parts = []
    for h0 in range(0, H, heads_per_call):
        h1 = min(H, h0 + heads_per_call)
        packed = tiled_pack(q[:, h0:h1], k[:, h0:h1], v[:, h0:h1], perm_heads(plan.q_perm, h0, h1),
                            perm_heads(plan.k_perm, h0, h1))
        parts.append(exact(*packed, plan, (h0, h1)))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([o for o, _ in parts], 1), torch.cat([s for _, s in parts], 1)
