"""The Triton attention kernel as a `torch.library` custom op, and the `triton` row of the attention."""
import torch

from ..custom_op import check_grad, fake_attention, op_name
from ..plan import BlockSparsePlan


@torch.library.custom_op(op_name("triton_block_sparse"), mutates_args=())
def triton_block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan_tensors: list[torch.Tensor],
                        block_size: int, groups: list[int], tail: str, precision: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `attention.block_sparse_triton` on the flattened plan, in `precision`."""
    from .attention import block_sparse_triton

    return block_sparse_triton(q, k, v, BlockSparsePlan.unflatten(plan_tensors, block_size, groups, tail),
                               precision=precision)


@triton_block_sparse.register_fake
def _fake(q, k, v, plan_tensors, block_size, groups, tail, precision):
    return fake_attention(q, k, v, plan_tensors, block_size, groups, tail)


class TritonAttention:
    """The `triton` row of the attention: the fused Triton kernel, through the custom op."""

    def attend_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                      precision: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, S, D] in q's dtype and model order, lse [B, H, S] fp32) of q, k, v under `plan`,
        the exact loop over the picks in `precision` ("bf16": the inputs' own, or "8-bit")."""
        check_grad(q, k, v, "triton")
        return triton_block_sparse(q, k, v, *plan.flatten(), precision)
