"""ComfyUI's core "Model Sparse Attention" node and the FastH3 checkpoints made for it.

Found on a model in either order to this pack's nodes (through chained block patches too), and
what this pack then does: the capture node refuses it; the sparse node leaves the attention to it
(strict refuses). A distilled FastH3 checkpoint (blocks with ``attn.to_gate_compress``) was trained
for VSA's pattern, which the core node runs (``vsa``) and this pack's tilings do not.
"""
from __future__ import annotations

from typing import Any, Callable

from ..errors import SparseAttentionError

# ComfyUI's own "Model Sparse Attention" node (BlockSparseAttention) registers its block patches
# from this module with set_model_patch_replace. Older versions replace whatever was there and
# never call it; newer ones chain it and mark their patches with a `_block_sparse_attention_patch`
# attribute, but still swap the attention of the calls they take and put their own attention
# override on the rest.
CORE_SPARSE_MODULE = "comfy_extras.nodes_sparse_attention"
CORE_SPARSE_MARK = "_block_sparse_attention_patch"
CORE_SPARSE_NODE = "ComfyUI's 'Model Sparse Attention' node (BlockSparseAttention)"


def double_block_patches(model_options: dict) -> dict[int, Callable]:
    """Block index -> the ("dit", "double_block", i) replacement registered in `model_options`."""
    dit = model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    return {key[1]: fn for key, fn in dit.items() if len(key) == 2 and key[0] == "double_block"}


def is_core_patch(fn: Callable | None) -> bool:
    """Whether a block replacement itself is ComfyUI's core sparse node's."""
    return getattr(fn, "__module__", None) == CORE_SPARSE_MODULE or hasattr(fn, CORE_SPARSE_MARK)


def is_core_sparse(fn: Callable | None) -> bool:
    """Whether a block replacement, or one it chains (this pack's `previous`, the core node's own
    `_block_sparse_attention_previous`), is ComfyUI's core sparse node's."""
    seen = 0
    while fn is not None and seen < 64:  # chains are a few nodes long; the bound only stops a cycle
        if is_core_patch(fn):
            return True
        fn, seen = getattr(fn, "previous", None), seen + 1
    return False


def core_sparse_blocks(model_options: dict) -> list[int]:
    """Blocks whose replacement is, or chains, ComfyUI's core sparse node's."""
    return sorted(i for i, fn in double_block_patches(model_options).items() if is_core_sparse(fn))


def core_sparse_order(model_options: dict) -> str | None:
    """Where the core sparse node sits relative to this pack's patches: "after" when it patched the
    blocks last, "before" when this pack's patches chain it, None when it is not on the model."""
    patches = double_block_patches(model_options).values()
    if any(is_core_patch(fn) for fn in patches):
        return "after"
    return "before" if any(is_core_sparse(fn) for fn in patches) else None


def core_sparse_message(title: str, order: str, blocks: int) -> str:
    """Why the sparse node leaves the attention to the core node found `order` ("before"/"after") it."""
    return (f"{title}: {CORE_SPARSE_NODE} is applied {order} this node on the same model ({blocks} H3 blocks). It "
            "runs the attention of those blocks, so this node leaves the attention to it and its own settings do "
            "not apply (remove one of the two nodes to choose; strict=True refuses the combination)")


def gated_blocks(diffusion_model: Any) -> int:
    """Blocks whose attention carries a ``to_gate_compress`` layer (distilled FastH3 checkpoints); a model
    without H3's block list (a stand-in, another wrapper) has none."""
    blocks = getattr(diffusion_model, "blocks", None) or ()
    return sum(getattr(getattr(b, "attn", None), "to_gate_compress", None) is not None for b in blocks)


def fasth3_message(title: str, gated: int, total: int) -> str:
    """What the sparse node says about a checkpoint trained for VSA's pattern."""
    return (f"{title}: this checkpoint's blocks carry to_gate_compress ({gated} of {total}): it is a distilled FastH3 "
            "checkpoint, trained for VSA's sparse pattern (4x4x4-token cubes, 10% of them kept, a coarse branch "
            "through that gate), which this node does not run. For sparse attention on it use ComfyUI's core "
            "'Model Sparse Attention' node (BlockSparseAttention) with method vsa, as the FastH3 template does; "
            "this node leaves the attention to ComfyUI (or to that node) here. tail='coarse' runs this node's own "
            "tiling with the checkpoint's gate instead, at your choice")


def refuse_core_sparse(model_options: dict, title: str, order: str) -> None:
    """Raise when ComfyUI's core sparse node patched the blocks too (in `order` to this node).

    Both replace the attention of the same blocks, and the core node either drops earlier block
    patches (older ComfyUI) or overrides the attention of every call it does not take itself (newer),
    so composing them would silently run something else than either node says; the user is told
    to keep one of them.
    """
    blocks = core_sparse_blocks(model_options)
    if blocks:
        raise SparseAttentionError(
            f"{title}: {CORE_SPARSE_NODE} is applied {order} this node on the same model ({len(blocks)} H3 blocks). "
            "Both replace the attention of the same blocks, so one of them would not run as set. "
            "Keep one of the two nodes (remove or bypass the other).")


