"""The compiled kernels as `torch.library` custom ops (one per kernel), so `torch.compile` can trace through them.

A custom op takes tensors and plain values, not dataclasses: the plan crosses it as
`BlockSparsePlan.flatten()` and is put back together inside by `BlockSparsePlan.unflatten`. The
ops' fake implementation only describes the outputs. Importing this module registers the ops, which
import Triton (and cuDNN) only when they run.
"""
import torch

from .plan import BlockSparsePlan


@torch.library.custom_op("adaptive_sparse_attention::triton_block_sparse", mutates_args=())
def triton_block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan_tensors: list[torch.Tensor],
                        block_size: int, groups: list[int], tail: str, precision: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `triton_attention.block_sparse_triton` on the flattened plan, in `precision`."""
    from .triton.attention import block_sparse_triton

    return block_sparse_triton(q, k, v, BlockSparsePlan.unflatten(plan_tensors, block_size, groups, tail),
                               precision=precision)


@torch.library.custom_op("adaptive_sparse_attention::cudnn_block_sparse", mutates_args=())
def cudnn_block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan_tensors: list[torch.Tensor],
                       block_size: int, groups: list[int], tail: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `cudnn_attention.block_sparse_cudnn` on the flattened plan."""
    from .cudnn.cudnn_attention import block_sparse_cudnn

    return block_sparse_cudnn(q, k, v, BlockSparsePlan.unflatten(plan_tensors, block_size, groups, tail))


@triton_block_sparse.register_fake
def _fake_triton(q, k, v, plan_tensors, block_size, groups, tail, precision):
    return _fake(q, k, v, plan_tensors, block_size, groups, tail)


@cudnn_block_sparse.register_fake
def _fake(q, k, v, plan_tensors, block_size, groups, tail):
    B, H, S, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, H, S, dtype=torch.float32)


class TritonAttention:
    """The `triton` row of the attention: the fused Triton kernel, through the custom op."""

    def attend_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                      precision: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, S, D] in q's dtype and model order, lse [B, H, S] fp32) of q, k, v under `plan`,
        the exact loop over the picks in `precision` ("bf16": the inputs' own, or "8-bit")."""
        check_grad(q, k, v, "triton")
        return triton_block_sparse(q, k, v, *plan.flatten(), precision)


class CudnnAttention:
    """The `cudnn` row of the attention: exact keys on cuDNN-frontend, the tail on Triton, through the custom op."""

    def attend_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                      precision: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, S, D] in q's dtype and model order, lse [B, H, S] fp32) of q, k, v under `plan`
        (bf16 only: the table resolves 8-bit calls elsewhere)."""
        if precision != "bf16":
            raise ValueError(f"kernel='cudnn': precision={precision!r} is not supported: expected 'bf16'")
        check_grad(q, k, v, "cudnn")
        return cudnn_block_sparse(q, k, v, *plan.flatten())


def check_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, family: str) -> None:
    """Refuse inputs that require grad (with grad mode on): the kernels are forward only, so this
    fails before anything runs instead of returning outputs whose backward fails later."""
    needs_grad = [name for name, t in (("q", q), ("k", k), ("v", v)) if t.requires_grad]
    if needs_grad and torch.is_grad_enabled():
        raise ValueError(f"kernel={family!r}: {', '.join(needs_grad)} require grad, but the fused kernels have no "
                         "backward: call it under torch.no_grad() or torch.inference_mode(), detach the inputs, or use "
                         "kernel='torch' (the differentiable reference)")
