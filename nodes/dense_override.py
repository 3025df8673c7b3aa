"""The attention override of the blocks the sparse node runs dense: the fastest exact kernel."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..backend.attention import DTYPES
from ..kernels.dense import DenseChoices


class DenseOverride:
    """``optimized_attention_override`` of the blocks our node runs dense: the fastest exact kernel.

    ComfyUI calls it with its own attention function and arguments; a call it does not serve (a
    mask, another attention precision) goes on to that function unchanged. Each patched model's
    state holds its own (`SparseAttentionHook.start_state`); the measured kernel choices it reads
    (`choices`) are shared by the clones of one node's model, as they are facts of the machine.
    """

    def __init__(self, choices: DenseChoices):
        self.choices = choices

    def __call__(self, func: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                 mask: Any = None, attn_precision: Any = None, skip_reshape: bool = False,
                 skip_output_reshape: bool = False, **kwargs: Any) -> torch.Tensor:
        if mask is not None or attn_precision is not None or kwargs.get("enable_gqa") or q.dtype not in DTYPES:
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)
        if not skip_reshape:  # [B, S, H * D] -> [B, H, S, D]
            q, k, v = (t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
        out = self.choices.attention(q, k, v)
        if skip_output_reshape:
            return out
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
