"""The sm90 attention: the Gluon kernel's exact keys of one packed head chunk as a `torch.library` custom op,
and the `sm90` row of the attention (`packed.PackedAttention`: the Triton family's pack and tail around it)."""
from typing import Callable

import torch

from ..custom_op import op_name
from ..packed import PackedAttention, fake_exact_keys
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
    return fake_exact_keys(qp)


def sm90_attention(tiled_pack: Callable, add_tail: Callable) -> PackedAttention:
    """The `sm90` row of the attention: exact keys on the Gluon kernel through the custom op, the Triton family's
    `tiled_pack` and `add_tail` (handed in by the registry) around it; the kernel's launcher checks the packed
    shapes it is given."""
    return PackedAttention("sm90", sm90_exact_keys, HEADS_PER_CALL, tiled_pack, add_tail)
