"""The Triton attention kernel as a `torch.library` custom op, and the `triton` row of the attention.

Also the two Triton kernels the family lends the cuDNN attention (`family.py` helpers, handed in by the
registry): the fused Q/K/V pack and the tail added to another kernel's exact keys, each its own custom
op, so the cuDNN attention that runs them around cuDNN's own op traces under `torch.compile` too.
"""
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


@torch.library.custom_op(op_name("triton_tiled_pack"), mutates_args=())
def triton_tiled_pack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_perm: torch.Tensor, k_perm: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous (qt, kt, vt) [B, H, L, D] of `tiled_pack.pack_qkv`: q packed by q_perm, k and v by k_perm."""
    from .tiled_pack import pack_qkv

    return pack_qkv(q, k, v, q_perm, k_perm)


@triton_tiled_pack.register_fake
def _fake_pack(q, k, v, q_perm, k_perm):
    B, H, _, D = q.shape
    return tuple(q.new_empty(B, H, q_perm.shape[-1], D) for _ in range(3))


@torch.library.custom_op(op_name("triton_add_tail"), mutates_args=())
def triton_add_tail(q: torch.Tensor, plan_tensors: list[torch.Tensor], block_size: int, groups: list[int], tail: str,
                    part_out: torch.Tensor, part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `attention.add_tail` on the flattened plan and the partial result (part_out, part_lse)."""
    from .attention import add_tail as finish

    return finish(q, BlockSparsePlan.unflatten(plan_tensors, block_size, groups, tail), (part_out, part_lse))


@triton_add_tail.register_fake
def _fake_tail(q, plan_tensors, block_size, groups, tail, part_out, part_lse):
    return fake_attention(q, q, q, plan_tensors, block_size, groups, tail)


def add_tail(q: torch.Tensor, plan: BlockSparsePlan, partial: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, S, D] in model order, lse [B, H, S]): the tail of `plan` added to `partial`, another kernel's
    exact keys (out [B, H, J * block_size, D] normalised, lse fp32, tiled order), through the custom op."""
    return triton_add_tail(q, *plan.flatten(), *partial)


class TritonAttention:
    """The `triton` row of the attention: the fused Triton kernel, through the custom op."""

    def attend_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                      precision: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, S, D] in q's dtype and model order, lse [B, H, S] fp32) of q, k, v under `plan`,
        the exact loop over the picks in `precision` ("bf16": the inputs' own, or "8-bit")."""
        check_grad(q, k, v, "triton")
        return triton_block_sparse(q, k, v, *plan.flatten(), precision)
