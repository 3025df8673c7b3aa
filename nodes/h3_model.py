"""Finding ComfyUI's MiniMax-H3 model and the packed-sequence layout of its calls."""
from __future__ import annotations

import sys
import threading
from typing import Any

import torch

from ..errors import SparseAttentionError
from ..backend.cache import BoundedCache
from ..backend.layout import SequenceLayout

LAYOUT_CACHE_SIZE = 8


def check_h3(diffusion_model: Any) -> None:
    """Raise ValueError unless `diffusion_model` is ComfyUI's MiniMax-H3 DiT."""
    cls = type(diffusion_model)
    blocks = getattr(diffusion_model, "blocks", None)
    shaped = bool(blocks) and all(
        all(hasattr(getattr(b, "attn", None), a) for a in ("qkv_proj", "q_norm", "k_norm", "out_proj", "heads", "head_dim"))
        for b in blocks)
    if cls.__name__ != "MiniMaxH3Model" or not shaped:
        raise SparseAttentionError(
            f"Adaptive Sparse Attention (MiniMax-H3) only patches ComfyUI's MiniMax-H3 model "
            f"(comfy.ldm.minimax.model.MiniMaxH3Model), but this MODEL's diffusion model is "
            f"{cls.__module__}.{cls.__name__}. Load a MiniMax-H3 checkpoint (UNETLoader) and connect it here.")


def h3_diffusion_model(model: Any, node: str) -> Any:
    """The MiniMax-H3 diffusion model of a ComfyUI MODEL input of `node`.

    Raises TypeError when `model` is not a ComfyUI MODEL (ModelPatcher), ValueError when its
    diffusion model is not ComfyUI's MiniMax-H3 (`check_h3`).
    """
    get = getattr(model, "get_model_object", None)
    if not callable(get) or not hasattr(model, "model_options"):
        raise TypeError(f"{node}.model must be a ComfyUI MODEL (a ModelPatcher, e.g. from UNETLoader), got "
                        f"{type(model).__module__}.{type(model).__name__}")
    try:
        diffusion_model = get("diffusion_model")
    except AttributeError as err:
        raise TypeError(f"{node}.model is a MODEL without a diffusion model ({err}); connect a MiniMax-H3 "
                        "model from UNETLoader") from err
    check_h3(diffusion_model)
    return diffusion_model


class LayoutCache(BoundedCache[SequenceLayout]):
    """ComfyUI ``PackedLayout`` -> `SequenceLayout`, cached per (signature, segments), bounded. Each layout
    keeps what was built and prepared for its shape (`backend/cache.ShapeCache`)."""

    def __init__(self, size: int = LAYOUT_CACHE_SIZE):
        super().__init__(size)
        self.lock = threading.Lock()  # ComfyUI's multi-GPU sampling calls one model from several threads

    def of(self, packed: Any) -> SequenceLayout:
        """The layout of a ComfyUI ``PackedLayout``, converted once per signature."""
        key = (getattr(packed, "signature", None), tuple(tuple(s) for s in packed.segments))
        with self.lock:
            return self.get(key, lambda: SequenceLayout.from_packed(packed))


def payload_layout(model: Any, x: Any, context: torch.Tensor, payload: dict) -> Any:
    """The PackedLayout this call runs with: the payload's when its signature matches, else a new one.

    Mirrors H3's own choice (older upstream passes no layout to the blocks).
    """
    video, audio = x[0], x[1]
    pt, ph, pw = getattr(model, "patch_size", (1, 2, 2))
    signature = (context.shape[1], -(-video.shape[2] // pt) * pt, -(-video.shape[3] // ph) * ph,
                 -(-video.shape[4] // pw) * pw, audio.shape[-1])
    layout = payload.get("layout")
    if layout is not None and getattr(layout, "signature", None) == signature:
        return layout
    packed_cls = getattr(sys.modules.get(type(model).__module__), "PackedLayout", None)
    if packed_cls is None:
        return None
    return packed_cls(*signature, keyframes=payload.get("keyframes"), refs=payload.get("refs"))


