"""Adaptive Sparse Attention for MiniMax-H3: a ComfyUI node pack and a plain-torch engine.

Public API: `SparseConfig`, `SequenceLayout`, `sparse_attention`, `SparseAttentionError`. ComfyUI loads the pack through
`comfy_entrypoint`; importing this package needs neither ComfyUI, nor a GPU, nor Triton.
"""
from .backend.attention import SparseInfo, sparse_attention
from .backend.config import SparseConfig
from .backend.layout import SequenceLayout
from .errors import SparseAttentionError
from .version import __version__

__all__ = ["SparseConfig", "SequenceLayout", "SparseInfo", "SparseAttentionError", "sparse_attention", "comfy_entrypoint"]
WEB_DIRECTORY = "./nodes/web"  # frontend extension: sizes the report node to fit its text


async def comfy_entrypoint():
    """ComfyUI V3 entry point; imports ComfyUI-facing code only when ComfyUI calls it."""
    from .nodes import extension

    return await extension()
