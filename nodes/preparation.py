"""The node's side of kernel preparation: once per layout, at the first block call that needs it (a warmup
step of a sparse layer, or the first sparse step), in this process (`backend.prepare.prepare`)."""
from __future__ import annotations

from typing import Any

import torch

from ..backend.config import SparseConfig
from ..backend.layout import SequenceLayout
from ..backend.prepare import prepare
from .comfy_weights import head_groups, outside_allocation_graph
from .progress import progress_text


def prepare_layout(config: SparseConfig, attn: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                   layout: SequenceLayout, head_chunks: Any) -> None:
    """Prepare the kernels of this layout's sparse calls, shown in the console and as progress text on the
    running node, at the head count of one sparse call (the largest of KJNodes' head groups, `head_chunks`).

    Args:
        config: the engine config of the sparse calls (precision resolved).
        attn: the block's attention module (heads, head size).
        dtype, device: of the block input.
        layout: the call's layout.
        head_chunks: KJNodes' ``minimax_head_chunks`` (1 without it).
    """
    head_dim = attn.head_dim
    heads = max(h1 - h0 for h0, h1 in head_groups(attn.heads, head_chunks))
    with outside_allocation_graph():
        prepare(layout, config, dtype, device, head_dim, heads, announce=progress_text)
