"""What `plan_reuse="auto"` counts for one shape of a run (`plan_reuse.Estimate`): the model's blocks that run
sparse, the cond/uncond branches a step runs as separate model calls, and the head groups of a block call."""
from __future__ import annotations

from typing import Any

from ..backend.config import SparseConfig
from ..backend.plan_reuse import Estimate
from .comfy_weights import head_groups

COND, UNCOND = 0, 1  # ComfyUI's cond_or_uncond entries


def branch_count(seen: dict[tuple, int | None], step: int | None) -> tuple[int, str]:
    """The branches (distinct ``cond_or_uncond`` keys) a step of the run runs, and why where it is a guess.

    Args:
        seen: each key the run's calls carried so far -> the step it was first seen at (None: unknown).
        step: the step of the call asking.
    Returns:
        (count, note): the keys seen where an earlier step of the run was seen (a step runs every branch);
        at the run's first step one more where the calls seen so far carry only one of cond and uncond (at
        cfg > 1 the other comes as its own call), with the note saying so; "" otherwise.
    """
    earlier = step is not None and any(s is not None and s < step for s in seen.values())
    members = {entry for key in seen for entry in key}
    if earlier or not members or {COND, UNCOND} <= members:
        return max(1, len(seen)), ""
    return len(seen) + 1, " (the run's first step: the other of cond and uncond may follow as its own call)"


def estimate(diffusion_model: Any, config: SparseConfig, heads: int, head_chunks: Any,
             seen: dict[tuple, int | None], step: int | None) -> Estimate:
    """The slots a run's kept plans of one shape fill, for a sparse call of `diffusion_model` under `config`.

    Args:
        diffusion_model: the H3 model the call runs on (its ``blocks``).
        config: the node's settings (``dense_layers`` run dense at every shape).
        heads: the block's attention heads.
        head_chunks: the call's ``minimax_head_chunks`` (`comfy_weights.head_groups`).
        seen, step: the run's branch keys and the call's step (`branch_count`).
    Returns:
        The `Estimate`.
    """
    blocks = sum(layer not in config.dense_layers for layer in range(len(diffusion_model.blocks)))
    branches, note = branch_count(seen, step)
    return Estimate(blocks, branches, len(head_groups(heads, head_chunks)), note)
