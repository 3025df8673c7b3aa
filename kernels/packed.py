"""The exact keys on a kernel that reads key blocks as contiguous rows (cuDNN-frontend's, the sm90 kernel).

Such a kernel takes Q, K and V in tiled order ([B, h, J * block_size, D], `plan.pack`'s order), so a call
packs them a few heads at a time (the Triton family's fused gather, handed in as `tiled_pack`), which bounds
the extra memory to those heads' copies, and runs the kernel on each chunk. What comes back is each row's
attention over its exact keys, normalised, with its log-sum-exp, in tiled order: the tail joins it after
(the Triton family's `add_tail`), in the same softmax. `PackedAttention` is such a family's attention row.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import SparseAttentionError
from .custom_op import check_grad
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


def fake_exact_keys(qp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a packed head chunk's exact-keys op returns, for its fake implementation: (out like qp, lse fp32)."""
    B, hc, L, _ = qp.shape
    return torch.empty_like(qp), qp.new_empty(B, hc, L, dtype=torch.float32)


class PackedAttention:
    """The attention row of a family whose exact keys run on packed key blocks: Q/K/V packed before its op and
    the tail added after it by the Triton family's helpers `tiled_pack` and `add_tail` (the row borrows them,
    the registry hands them in), all custom ops, so the whole attention traces under `torch.compile`.

    Args:
        family: the family's name (for errors).
        exact_op: the custom op of one packed head chunk, (qp, kp, vp, *plan.flatten(), h0) -> (out, lse).
        heads_per_call: heads packed at once.
        tiled_pack, add_tail: the Triton family's helpers.
        check: raises where the family cannot take the call, (q, plan) -> None (None: the op checks what it is
            given).
    """

    def __init__(self, family: str, exact_op: Callable, heads_per_call: int, tiled_pack: Callable,
                 add_tail: Callable, check: Callable[[torch.Tensor, BlockSparsePlan], None] | None = None):
        self.family, self.exact_op, self.heads_per_call, self.check = family, exact_op, heads_per_call, check
        self.tiled_pack, self.add_tail = tiled_pack, add_tail

    def attend_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                      precision: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, S, D] in q's dtype and model order, lse [B, H, S] fp32) of q, k, v under `plan`
        (bf16 only: the registry resolves 8-bit calls elsewhere)."""
        if precision != "bf16":
            raise SparseAttentionError(f"kernel={self.family!r}: precision={precision!r} is not supported: "
                                       "expected 'bf16'")
        check_grad(q, k, v, self.family)
        if self.check is not None:
            self.check(q, plan)
        flat = plan.flatten()

        def exact(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, _: BlockSparsePlan, heads: tuple[int, int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
            return self.exact_op(qp, kp, vp, *flat, heads[0])

        return self.add_tail(q, plan, exact_in_chunks(q, k, v, plan, self.tiled_pack, exact, self.heads_per_call))
