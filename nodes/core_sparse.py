"""ComfyUI's core "Model Sparse Attention" node: found on a model and refused next to this pack's."""
from __future__ import annotations

from typing import Callable

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


def core_sparse_blocks(model_options: dict) -> list[int]:
    """Blocks whose replacement comes from ComfyUI's core sparse node."""
    return sorted(i for i, fn in double_block_patches(model_options).items()
                  if getattr(fn, "__module__", None) == CORE_SPARSE_MODULE or hasattr(fn, CORE_SPARSE_MARK))


def refuse_core_sparse(model_options: dict, title: str, order: str) -> None:
    """Raise when ComfyUI's core sparse node patched the blocks too (in `order` to this node).

    Both replace the attention of the same blocks, and the core node either drops earlier block
    patches (older ComfyUI) or overrides the attention of every call it does not take itself (newer),
    so composing them would silently run something else than either node says; the user is told
    to keep one of them.
    """
    blocks = core_sparse_blocks(model_options)
    if blocks:
        raise ValueError(
            f"{title}: {CORE_SPARSE_NODE} is applied {order} this node on the same model ({len(blocks)} H3 blocks). "
            "Both replace the attention of the same blocks, so one of them would silently not run as set. "
            "Keep one of the two nodes (remove or bypass the other).")


