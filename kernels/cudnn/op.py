"""The cuDNN attention: cuDNN's exact keys of one packed head chunk as a `torch.library` custom op, and the
`cudnn` row of the attention, which runs the Triton family's pack and tail (their own custom ops, handed
in by the registry) around it, so the whole attention traces under `torch.compile`."""
from typing import Callable

import torch

from ...errors import SparseAttentionError
from ..custom_op import check_grad, op_name
from ..plan import BlockSparsePlan
from .cudnn_attention import block_sparse_cudnn, exact_keys


@torch.library.custom_op(op_name("cudnn_block_sparse"), mutates_args=())
def cudnn_block_sparse(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, plan_tensors: list[torch.Tensor],
                       block_size: int, groups: list[int], tail: str, h0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `cudnn_attention.exact_keys` on heads [h0, h0 + qp.shape[1]) packed, on the flattened plan."""
    plan = BlockSparsePlan.unflatten(plan_tensors, block_size, groups, tail)
    return exact_keys(qp, kp, vp, plan, (h0, h0 + qp.shape[1]))


@cudnn_block_sparse.register_fake
def _fake(qp, kp, vp, plan_tensors, block_size, groups, tail, h0):
    B, hc, L, _ = qp.shape
    return torch.empty_like(qp), qp.new_empty(B, hc, L, dtype=torch.float32)


class CudnnAttention:
    """The `cudnn` row of the attention: exact keys on cuDNN-frontend through the custom op, Q/K/V packed
    before it and the tail added after it by the Triton family's helpers `tiled_pack` and `add_tail`
    (the row borrows them, `family.py`: the registry hands them in)."""

    def __init__(self, tiled_pack: Callable, add_tail: Callable):
        self.tiled_pack, self.add_tail = tiled_pack, add_tail

    def attend_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                      precision: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, S, D] in q's dtype and model order, lse [B, H, S] fp32) of q, k, v under `plan`
        (bf16 only: the registry resolves 8-bit calls elsewhere)."""
        if precision != "bf16":
            raise SparseAttentionError(f"kernel='cudnn': precision={precision!r} is not supported: expected 'bf16'")
        check_grad(q, k, v, "cudnn")
        flat = plan.flatten()

        def exact(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, _: BlockSparsePlan, heads: tuple[int, int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
            return cudnn_block_sparse(qp, kp, vp, *flat, heads[0])

        return block_sparse_cudnn(q, k, v, plan, self.tiled_pack, self.add_tail, exact)
