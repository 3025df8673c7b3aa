"""The sm90 attention: the Gluon kernel's exact keys of one packed head chunk as a `torch.library` custom op,
and the `sm90` row of the attention, which runs the Triton family's pack and tail (their own custom ops,
handed in by the registry) around it, so the whole attention traces under `torch.compile`."""
from typing import Callable

import torch

from ...errors import SparseAttentionError
from ..custom_op import check_grad, op_name
from ..packed import exact_in_chunks
from ..plan import BlockSparsePlan

HEADS_PER_CALL = 8  # packed Q/K/V copies stay at most 8 / H of Q/K/V's size


@torch.library.custom_op(op_name("sm90_exact_keys"), mutates_args=())
def sm90_exact_keys(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, plan_tensors: list[torch.Tensor],
                    block_size: int, groups: list[int], tail: str, h0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `attention.exact_keys_sm90` on heads [h0, h0 + qp.shape[1]) packed, on the flattened plan."""
    from .attention import exact_keys_sm90

    plan = BlockSparsePlan.unflatten(plan_tensors, block_size, groups, tail)
    return exact_keys_sm90(qp, kp, vp, plan, (h0, h0 + qp.shape[1]))


@sm90_exact_keys.register_fake
def _fake(qp, kp, vp, plan_tensors, block_size, groups, tail, h0):
    B, hc, L, _ = qp.shape
    return torch.empty_like(qp), qp.new_empty(B, hc, L, dtype=torch.float32)


class Sm90Attention:
    """The `sm90` row of the attention: exact keys on the Gluon kernel through the custom op, Q/K/V packed
    before it and the tail added after it by the Triton family's helpers `tiled_pack` and `add_tail`
    (the row borrows them, `family.py`: the registry hands them in)."""

    def __init__(self, tiled_pack: Callable, add_tail: Callable):
        self.tiled_pack, self.add_tail = tiled_pack, add_tail

    def attend_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                      precision: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, S, D] in q's dtype and model order, lse [B, H, S] fp32) of q, k, v under `plan`
        (bf16 only: the registry resolves 8-bit calls elsewhere)."""
        if precision != "bf16":
            raise SparseAttentionError(f"kernel='sm90': precision={precision!r} is not supported: expected 'bf16'")
        check_grad(q, k, v, "sm90")
        flat = plan.flatten()

        def exact(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, _: BlockSparsePlan, heads: tuple[int, int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
            return sm90_exact_keys(qp, kp, vp, *flat, heads[0])

        return self.add_tail(q, plan, exact_in_chunks(q, k, v, plan, self.tiled_pack, exact, HEADS_PER_CALL))
