"""The cuDNN attention: cuDNN's exact keys of one packed head chunk as a `torch.library` custom op, and the
`cudnn` row of the attention (`packed.PackedAttention`: the Triton family's pack and tail around it)."""
from typing import Callable

import torch

from ..custom_op import op_name
from ..packed import PackedAttention, fake_exact_keys
from ..plan import BlockSparsePlan
from .cudnn_attention import HEADS_PER_CALL, check_call, exact_keys


@torch.library.custom_op(op_name("cudnn_block_sparse"), mutates_args=())
def cudnn_block_sparse(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, plan_tensors: list[torch.Tensor],
                       block_size: int, groups: list[int], tail: str, h0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `cudnn_attention.exact_keys` on heads [h0, h0 + qp.shape[1]) packed, on the flattened plan."""
    plan = BlockSparsePlan.unflatten(plan_tensors, block_size, groups, tail)
    return exact_keys(qp, kp, vp, plan, (h0, h0 + qp.shape[1]))


@cudnn_block_sparse.register_fake
def _fake(qp, kp, vp, plan_tensors, block_size, groups, tail, h0):
    return fake_exact_keys(qp)


def cudnn_attention(tiled_pack: Callable, add_tail: Callable) -> PackedAttention:
    """The `cudnn` row of the attention: exact keys on cuDNN-frontend through the custom op, the Triton family's
    `tiled_pack` and `add_tail` (handed in by the registry) around it."""
    return PackedAttention("cudnn", cudnn_block_sparse, HEADS_PER_CALL, tiled_pack, add_tail, check_call)
