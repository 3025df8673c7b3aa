"""ComfyUI-facing code: the V3 nodes. Imports ComfyUI's API only when ComfyUI asks for the nodes."""
from __future__ import annotations

from typing import Any


async def extension() -> Any:
    """The pack's ComfyExtension (called by the package's `comfy_entrypoint`)."""
    from comfy_api.latest import ComfyExtension

    from .capture_node import CaptureH3Attention
    from .raylight_node import AdaptiveSparseAttentionH3Raylight
    from .report_node import SparseAttentionReport
    from .sparse_node import AdaptiveSparseAttentionH3

    class AdaptiveSparseAttentionExtension(ComfyExtension):
        async def get_node_list(self) -> list:
            return [AdaptiveSparseAttentionH3, AdaptiveSparseAttentionH3Raylight, CaptureH3Attention,
                    SparseAttentionReport]

    return AdaptiveSparseAttentionExtension()
