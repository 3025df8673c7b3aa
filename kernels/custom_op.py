"""The compiled kernels as one `torch.library` custom op, so `torch.compile` can trace through them.

A custom op takes tensors and plain values, not dataclasses: the plan crosses it as
`BlockSparsePlan.flatten()` and is put back together inside by `BlockSparsePlan.unflatten`. The
op's fake implementation only describes the outputs. Importing this module registers the op; it
imports Triton (and cuDNN) only when the op actually runs.
"""
import torch

from .plan import BlockSparsePlan


@torch.library.custom_op("adaptive_sparse_attention::block_sparse_kernel", mutates_args=())
def block_sparse_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan_tensors: list[torch.Tensor],
                        block_size: int, groups: list[int], tail: str, kernel: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `triton_attention.block_sparse_triton` or `cudnn_attention.block_sparse_cudnn`."""
    plan = BlockSparsePlan.unflatten(plan_tensors, block_size, groups, tail)
    if kernel == "cudnn":
        from .cudnn_attention import block_sparse_cudnn

        return block_sparse_cudnn(q, k, v, plan)
    from .triton_attention import block_sparse_triton

    return block_sparse_triton(q, k, v, plan)


@block_sparse_kernel.register_fake
def _fake(q, k, v, plan_tensors, block_size, groups, tail, kernel):
    B, H, S, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, H, S, dtype=torch.float32)


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q, k, v under `plan` on the fused Triton kernel, through the custom op."""
    return block_sparse_op(q, k, v, plan, "triton")


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q, k, v under `plan`: exact keys on cuDNN-frontend, the tail on Triton, through the custom op."""
    return block_sparse_op(q, k, v, plan, "cudnn")


def block_sparse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                    kernel: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """Call the custom op with `plan` on `kernel` ("triton" or "cudnn").

    The kernels are forward only: inputs that require grad (with grad mode on) are refused here,
    before anything runs, instead of returning outputs whose backward fails later."""
    needs_grad = [name for name, t in (("q", q), ("k", k), ("v", v)) if t.requires_grad]
    if needs_grad and torch.is_grad_enabled():
        raise ValueError(f"backend={kernel!r}: {', '.join(needs_grad)} require grad, but the fused kernels have no "
                         "backward: call it under torch.no_grad() or torch.inference_mode(), detach the inputs, or use "
                         "backend='torch' (the differentiable reference)")
    return block_sparse_kernel(q, k, v, *plan.flatten(), kernel)
