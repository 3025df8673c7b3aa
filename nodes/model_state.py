"""What every patch and clone of one loaded H3 model shares: its layouts and the measured kernel choices.

A layout keeps what was built and prepared for its shape (the planner's statics, the kernels' preparation),
so a second sampler call, a clone ComfyUI makes and a model patched again with other widgets build and
prepare a shape once. The state hangs on the diffusion model itself (the object every ModelPatcher clone of
one loaded checkpoint shares) and goes with it; a deep copy of the model (a clone on another GPU) starts with
its own layouts and shares the choices, which are facts of the machine, keyed by GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..kernels.dense.choice import DenseChoices, default_cache_path
from ..kernels.sparse_choice.choice import SparseChoices
from ..kernels.sparse_choice.choice import default_cache_path as sparse_cache_path
from .comfy_weights import outside_allocation_graph
from .h3_model import LayoutCache

# on a diffusion model: its `ModelState`, one per copy of this package in the process (a benchmark imports the
# pack under its own name beside ComfyUI's import of the custom node: each copy keeps its own classes' objects)
STATE_ATTR = f"adaptive_sparse_attention_state:{__name__}"


@dataclass
class ModelState:
    """The layouts of one loaded model's calls and the dense- and sparse-kernel choices its patches run."""

    layouts: LayoutCache
    dense_choices: DenseChoices
    sparse_choices: SparseChoices

    @classmethod
    def new(cls) -> ModelState:
        """Empty layouts; the choices read from (and saved to) ComfyUI's user directory when it is loaded."""
        return cls(LayoutCache(), dense_choices(), SparseChoices(sparse_cache_path(comfy_user_dir())))

    def __deepcopy__(self, memo: dict) -> ModelState:
        """A deep copy of the model (a clone on another device): its own layouts, the same choices."""
        return ModelState(LayoutCache(self.layouts.size), self.dense_choices, self.sparse_choices)


def model_state(diffusion_model: Any) -> ModelState:
    """The `ModelState` of `diffusion_model`, made at its first use."""
    state = diffusion_model.__dict__.get(STATE_ATTR)
    if state is None:
        state = diffusion_model.__dict__.setdefault(STATE_ATTR, ModelState.new())
    return state


def dense_choices() -> DenseChoices:
    """Dense-kernel choices read from (and saved to) ComfyUI's user directory, measured outside ComfyUI's
    allocation graph (`comfy_weights.outside_allocation_graph`), as the sparse path runs."""
    return DenseChoices(default_cache_path(comfy_user_dir()), paused=outside_allocation_graph)


def comfy_user_dir() -> str | None:
    """ComfyUI's user directory when ComfyUI is loaded, else None."""
    try:
        import folder_paths
        return folder_paths.get_user_directory()
    except (ImportError, AttributeError):
        return None

