"""The compiled kernels as one `torch.library` custom op, so `torch.compile` can trace through them.

The op takes the plan's tensors one by one (custom ops accept tensors, not dataclasses), the
routing groups flattened, and the kernel to run (`triton`, or `cudnn` for the exact keys on
cuDNN-frontend); its fake implementation only describes the outputs. Importing this module
registers the op; it imports Triton (and cuDNN) only when the op actually runs.
"""
from typing import Optional

import torch

from .plan import BlockSparsePlan, BlockSummaries, QuerySummaries, Tail, Tiling


@torch.library.custom_op("adaptive_sparse_attention::block_sparse_attention", mutates_args=())
def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_perm: torch.Tensor, k_perm: torch.Tensor, block_len: torch.Tensor, dense_hi: torch.Tensor,
    q2k_idx: torch.Tensor, q2k_num: torch.Tensor,
    tail_k: Optional[torch.Tensor], tail_v: Optional[torch.Tensor], tail_bias: Optional[torch.Tensor],
    block_logit: Optional[torch.Tensor], block_value: Optional[torch.Tensor],
    block_size: int, groups: list[int], kernel: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `triton_attention.block_sparse_triton` or `cudnn_attention.block_sparse_cudnn`."""

    tail: Tail = None
    if tail_k is not None:
        tail = QuerySummaries(tail_k, tail_v, tail_bias)
    elif block_logit is not None:
        tail = BlockSummaries(block_logit, block_value)
    routing_groups = tuple(tuple(groups[i:i + 3]) for i in range(0, len(groups), 3))  # (lo, hi, budget) each
    plan = BlockSparsePlan(Tiling(block_size, q_perm, k_perm, block_len), dense_hi, q2k_idx, q2k_num,
                           routing_groups, tail)
    if kernel == "cudnn":
        from .cudnn_attention import block_sparse_cudnn

        return block_sparse_cudnn(q, k, v, plan)
    from .triton_attention import block_sparse_triton

    return block_sparse_triton(q, k, v, plan)


@block_sparse_attention.register_fake
def _fake(q, k, v, q_perm, k_perm, block_len, dense_hi, q2k_idx, q2k_num,
          tail_k, tail_v, tail_bias, block_logit, block_value, block_size, groups, kernel):
    B, H, S, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, H, S, dtype=torch.float32)


def block_sparse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan,
                    kernel: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """Call the custom op with the tensors of `plan` on `kernel` ("triton" or "cudnn").

    The kernels are forward only: inputs that require grad (with grad mode on) are refused here,
    before anything runs, instead of returning outputs whose backward fails later."""
    needs_grad = [name for name, t in (("q", q), ("k", k), ("v", v)) if t.requires_grad]
    if needs_grad and torch.is_grad_enabled():
        raise ValueError(f"backend={kernel!r}: {', '.join(needs_grad)} require grad, but the fused kernels have no "
                         "backward: call it under torch.no_grad() or torch.inference_mode(), detach the inputs, or use "
                         "backend='torch' (the differentiable reference)")
    query = plan.tail if isinstance(plan.tail, QuerySummaries) else None
    block = plan.tail if isinstance(plan.tail, BlockSummaries) else None
    return block_sparse_attention(q, k, v, plan.q_perm, plan.k_perm, plan.block_len, plan.dense_hi,
                                  plan.q2k_idx, plan.q2k_num,
                                  query.key if query else None, query.value if query else None,
                                  query.bias if query else None, block.logit if block else None,
                                  block.value if block else None, plan.block_size,
                                  [x for g in plan.groups for x in g], kernel)
