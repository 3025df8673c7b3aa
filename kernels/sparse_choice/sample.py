"""The rows a sparse-kernel candidate is checked on, and the float32 reference on them.

A candidate runs on the whole real plan; its output is compared on a sample: batch 0, the first and
last head, SAMPLE_BLOCKS query blocks spread evenly over the tiled order (the first holds context
rows with their dense prefix, the last the edge block, those between video rows with picks and
tails). The reference is the torch oracle (`block_sparse_reference`, the `torch` family's helper
"oracle") in float32 on the same stored values, computed for the sampled blocks only, so the check costs a few blocks' attention, not a call's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plan import BlockSparsePlan, pack
from ..registry import helper

SAMPLE_BLOCKS = 16  # query blocks checked per head


def sampled_blocks(num_blocks: int, count: int = SAMPLE_BLOCKS) -> tuple[int, ...]:
    """`count` block indices spread evenly over [0, num_blocks), the first and last included."""
    if num_blocks <= count:
        return tuple(range(num_blocks))
    return tuple(sorted({round(i * (num_blocks - 1) / (count - 1)) for i in range(count)}))


def head_rows(t: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """Batch 0 and `heads` of a [B, H, ...] tensor; a tensor shared by all heads (H = 1) as it is."""
    return t[:1] if t.shape[1] == 1 else t[:1].index_select(1, heads)


def head_plan(plan: BlockSparsePlan, heads: torch.Tensor) -> BlockSparsePlan:
    """`plan` restricted to batch 0 and `heads` (its block lengths and dense prefix are shared)."""
    tensors, block_size, groups, kind = plan.flatten()
    q_perm, k_perm, block_len, dense_hi, *per_head = tensors
    sliced = [head_rows(q_perm, heads), head_rows(k_perm, heads), block_len, dense_hi,
              *(head_rows(t, heads) for t in per_head)]
    return BlockSparsePlan.unflatten(sliced, block_size, groups, kind)


@dataclass(frozen=True)
class Sample:
    """The checked rows of one call and the float32 reference there.

    Attributes:
        heads: the checked heads (batch 0).
        perm: the query permutation of those heads.
        slots: the tiled slots of the sampled blocks.
        reference: float32 [1, len(heads), len(slots), D]: the reference output at those slots.
    """

    heads: torch.Tensor
    perm: torch.Tensor
    slots: torch.Tensor
    reference: torch.Tensor

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan) -> "Sample":
        """The sample of a call on q, k, v [B, H, S, D] under `plan`.

        Args:
            q, k, v: the call's inputs, model order.
            plan: its plan.
        Returns:
            The sample, its reference computed (on q's device).
        """
        heads = torch.tensor(sorted({0, q.shape[1] - 1}), device=q.device)
        sub = head_plan(plan, heads)
        blocks = sampled_blocks(plan.num_blocks)
        bs = plan.block_size
        slots = (torch.tensor(blocks, device=q.device).view(-1, 1) * bs + torch.arange(bs, device=q.device)).view(-1)
        q32, k32, v32 = (head_rows(t, heads).float() for t in (q, k, v))
        out, _ = helper("torch", "oracle")(q32, k32, v32, sub, query_blocks=blocks)
        return cls(heads, sub.q_perm, slots, pack(out, sub.q_perm)[:, :, slots])

    def error(self, out: torch.Tensor) -> float:
        """Relative L2 error of a candidate's output [B, H, S, D] on the sampled rows (synchronises).

        Args:
            out: the candidate's output, model order.
        Returns:
            ||out - reference|| / ||reference|| on the sample, in float32 (padding slots are zero in both).
        """
        rows = pack(head_rows(out, self.heads).float(), self.perm)[:, :, self.slots]
        return float((rows - self.reference).norm() / self.reference.norm().clamp_min(1e-30))
