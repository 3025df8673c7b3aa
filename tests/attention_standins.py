"""Stand-ins for what the precision tests read of ComfyUI without importing it: attention functions named
and wrapped as ComfyUI's, a model whose module bound one at import, and the ModelPatcher's surface."""
from __future__ import annotations

import functools
import sys
import types

import pytest
import torch

ATTENTION = "comfy.ldm.modules.attention"


def comfy_function(name: str, module: str = ATTENTION, result=None):
    """A function named as ComfyUI's `name`, wrapped as ComfyUI's wrap_attn wraps its attention functions."""
    def inner(*args, **kwargs):
        return result
    inner.__module__, inner.__qualname__, inner.__name__ = module, name, name

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        return inner(*args, **kwargs)
    return wrapper


def launched(monkeypatch: pytest.MonkeyPatch, bound: str) -> torch.nn.Module:
    """A model whose module bound `optimized_attention` (ComfyUI's `bound`) at import, as ComfyUI's H3 module does."""
    module = types.ModuleType("fake_h3_model")
    module.optimized_attention = comfy_function(bound)
    monkeypatch.setitem(sys.modules, "fake_h3_model", module)
    return type("MiniMaxH3Model", (torch.nn.Module,), {"__module__": "fake_h3_model"})()


class Patcher:
    """What the hook reads of a ModelPatcher when sampling starts."""

    def __init__(self, diffusion_model, override=None):
        self.diffusion_model = diffusion_model
        self.model_options = {"transformer_options": {} if override is None else
                              {"optimized_attention_override": override}}

    def get_model_object(self, name):
        return self.diffusion_model if name == "diffusion_model" else None
