"""The cuDNN attention as a `torch.library` custom op, and the `cudnn` row of the attention."""
import torch

from ...errors import SparseAttentionError
from ..custom_op import check_grad, fake_attention, op_name
from ..plan import BlockSparsePlan


@torch.library.custom_op(op_name("cudnn_block_sparse"), mutates_args=())
def cudnn_block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan_tensors: list[torch.Tensor],
                       block_size: int, groups: list[int], tail: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `cudnn_attention.block_sparse_cudnn` on the flattened plan."""
    from .cudnn_attention import block_sparse_cudnn

    return block_sparse_cudnn(q, k, v, BlockSparsePlan.unflatten(plan_tensors, block_size, groups, tail))


cudnn_block_sparse.register_fake(fake_attention)


class CudnnAttention:
    """The `cudnn` row of the attention: exact keys on cuDNN-frontend, the tail on Triton, through the custom op."""

    def attend_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                      precision: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, S, D] in q's dtype and model order, lse [B, H, S] fp32) of q, k, v under `plan`
        (bf16 only: the registry resolves 8-bit calls elsewhere)."""
        if precision != "bf16":
            raise SparseAttentionError(f"kernel='cudnn': precision={precision!r} is not supported: expected 'bf16'")
        check_grad(q, k, v, "cudnn")
        return cudnn_block_sparse(q, k, v, *plan.flatten())
