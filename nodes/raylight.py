"""Sparse attention under Raylight's sequence parallelism (xFuser Ulysses), on each Ray worker.

Raylight runs H3 on several GPUs by replacing the model's forward and every block's
``attn.forward`` with its own (its USP path): each rank projects q/k/v for its shard of the rows,
xFuser's all-to-all gives it all rows of H/P heads, and xFuser calls its ring-attention function
there. Raylight's inner-attention slot (``raylight.distributed_modules.inner_attention``) hooks
that call: the object in ``transformer_options["raylight_inner_attention"]`` is called with the
post-all-to-all q/k/v [B, S, H/P, D] and the dense attention it replaces. `RaylightSparseAttention`
is that object; it runs `local_heads_attention` on the rank's heads, which plans exactly as one
GPU does for the same heads.

ComfyUI's ``optimized_attention_override`` is never reached on that path, and xFuser passes no
transformer_options to the ring function, so the state lives in the worker: the
DIFFUSION_MODEL wrapper records the denoising step and the packed layout once per model call,
and a ("dit", "double_block", i) replacement marks in its copy of transformer_options the layers
that run sparse (Raylight's blocks hand transformer_options on to their attention, and its slot
hands them to the processor). Unmarked calls run Raylight's dense attention unchanged.

Refused with a clear error when the node is applied: ring degree > 1, and Ulysses degrees that do
not divide the model's heads. Without sequence parallelism (data, CFG or FSDP parallel only)
Raylight runs H3's own forward, and the single-GPU patch applies unchanged.
"""
from __future__ import annotations

import dataclasses
import math
import os
from types import MappingProxyType
from typing import Any, Callable

import torch

from ..backend.attention import check_inputs
from ..backend.config import SparseConfig
from ..backend.layout import SequenceLayout
from ..backend.planner import layout_kernels
from ..backend.ulysses import check_sequence_parallel, local_heads_attention, padded_rows
from .model_patches import install
from .h3_model import check_h3
from .block_hook import CallContext, Mark
from .schedule import schedule_reason
from .sparse_policy import SparseAttentionHook, apply_sparse_attention

# keyword arguments of xFuser's ring-attention call and the only values sparse attention matches
XFUSER_EXPECTED = MappingProxyType({
    "dropout_p": 0.0, "causal": False, "window_size": (-1, -1), "alibi_slopes": None, "return_attn_probs": False,
    "joint_tensor_key": None, "joint_tensor_value": None, "attn_processor": None, "attn_layer": None,
    "q_descale": None, "k_descale": None, "v_descale": None})


def _matches(value: Any, expected: Any) -> bool:
    if expected is None:
        return value is None
    if isinstance(expected, tuple):
        return isinstance(value, (tuple, list)) and tuple(value) == expected
    return not torch.is_tensor(value) and value == expected


class RaylightSparseAttention(SparseAttentionHook):
    """Raylight inner-attention processor: adaptive sparse attention on this rank's head group.

    Its step and layout plumbing (DIFFUSION_MODEL wrapper, run report) is the single-GPU hook's;
    `decide` marks the layers that run sparse, and calling the object runs their attention.
    """

    kind = "raylight"
    supports_ring = False  # Raylight's slot refuses a processor without ring support when ring degree > 1

    def __init__(self, config: SparseConfig, heads: int, ulysses_degree: int):
        check_sequence_parallel(heads, ulysses_degree)
        self.heads, self.degree = heads, ulysses_degree
        super().__init__(config)

    @property
    def title(self) -> str:
        """The hook's name in log messages and errors."""
        return "adaptive sparse attention (Raylight)"

    def decide(self, layer: int, attn: torch.nn.Module, args: dict, ctx: CallContext) -> Any:
        """(step, layout) when this block call runs sparse, else None; x is this rank's row shard."""
        x = args["img"]
        layout = self.layout(args, ctx)
        rows = layout.total if layout is not None else x.shape[0] * self.degree
        reason = None
        if schedule_reason(self.config, layer, self.warmup(ctx), rows) is None:
            problem = self.shard_problem(x, layout)
            slow = None if problem is not None else self.slow_kernel(layout, x.dtype, x.device, attn.head_dim)
            if problem is None and slow is None:
                # strict raises here when the asked-for kernel family cannot run
                layout_kernels(layout, self.engine_config, x.device, x.dtype, attn.head_dim)
                return ctx.step, layout
            if problem is not None:
                self.refuse(layer, problem)
            else:
                reason = self.dense_instead(slow)
        self.tracker.note_block(ctx.step, sparse=False, reason=reason)
        return None

    def shard_problem(self, x: torch.Tensor, layout: SequenceLayout | None) -> str | None:
        """Why this rank's block input does not fit the layout, or None."""
        if layout is None:
            return "the packed-sequence layout was not found (the model call carried no minimax_payload layout)"
        padded = padded_rows(layout.total, self.degree)
        if x.dim() != 2 or x.shape[0] * self.degree != padded:
            return (f"block input of shape {tuple(x.shape)} is not 1/{self.degree} of the layout's {layout.total} "
                    f"rows padded to {padded}")
        return None

    def call_problem(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                     options: dict) -> str | None:
        """Why xFuser's call cannot run sparse (its flags, shapes, dtypes), or None."""
        for name, expected in XFUSER_EXPECTED.items():
            value = options.get(name, expected)
            if not _matches(value, expected):
                shown = f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else repr(value)
                return f"xFuser passed {name}={shown}; sparse attention runs only with {name}={expected!r}"
        scale = options.get("softmax_scale")
        if scale is not None and q.dim() == 4 and not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
            return f"xFuser passed softmax_scale={scale}; sparse attention uses head_dim ** -0.5"
        padded = padded_rows(layout.total, self.degree)
        if q.dim() != 4 or q.shape[1] != padded or q.shape[2] * self.degree != self.heads:
            return (f"after the all-to-all q has shape {tuple(q.shape)}, expected [B, {padded}, "
                    f"{self.heads // self.degree}, D] ({self.heads} heads over {self.degree} ranks)")
        try:
            check_inputs(*(t[:, :layout.total].transpose(1, 2) for t in (q, k, v)), layout)
        except ValueError as err:
            return str(err)
        return None

    @torch.compiler.disable(recursive=False)
    def __call__(self, dense_attention: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 transformer_options: dict, **options: Any) -> torch.Tensor:
        """Raylight's processor call: q, k, v [B, S, H/P, D] after the all-to-all; `options` are xFuser's
        ring-attention keywords, passed on unchanged when the call runs dense.

        This object sits in ``transformer_options`` and is shared by every clone of the model; the
        call runs with the state of the model it runs on (the hook in the block's `Mark`). Under
        torch.compile it reads the mark eagerly (compiled code would freeze it, see `nodes/block_hook.py`);
        xFuser's dense attention under it still compiles."""
        mark = transformer_options.get(self.key)
        if not (isinstance(mark, Mark) and mark.token is not None):  # not a sparse layer (or not our model call)
            return dense_attention(q, k, v, **options)
        return mark.ctx.hook.run_marked(mark.layer, mark.token, dense_attention, q, k, v, options)

    @torch.compiler.disable
    def run_marked(self, layer: int, token: tuple, dense_attention: Callable, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, options: dict) -> torch.Tensor:
        """The attention of a block call `decide` let run sparse (dense when xFuser's call does not fit)."""
        step, layout = token
        problem = self.call_problem(q, k, v, layout, options)
        if problem is not None:
            self.refuse(layer, problem)
            self.tracker.note_block(step, sparse=False)
            return dense_attention(q, k, v, **options)
        timer = self.tracker.start_timer(q)
        density = self.tracker.densities.get(layout.signature())
        if density is None:  # measured once per shape and run: it needs a host sync
            out, info = local_heads_attention(q, k, v, layout, self.engine_config, return_info=True)
            density = self.tracker.densities.setdefault(layout.signature(), info.density)
        else:
            out = local_heads_attention(q, k, v, layout, self.engine_config)
        self.tracker.stop_timer(timer)
        self.tracker.note_block(step, sparse=True, density=density)
        return out


def parallel_degrees() -> tuple[int, int]:
    """(Ulysses, ring) degrees of this worker's xFuser state; (1, 1) without xFuser or before its set-up."""
    try:
        from xfuser.core.distributed import (get_ring_parallel_world_size, get_ulysses_parallel_world_size,
                                             model_parallel_is_initialized)
    except ImportError:
        return 1, 1
    if not model_parallel_is_initialized():
        return 1, 1
    return int(get_ulysses_parallel_world_size()), int(get_ring_parallel_world_size())


def inner_attention_slot() -> tuple[str, Callable]:
    """Raylight's (INNER_ATTENTION_KEY, set_inner_attention), or a RuntimeError saying Raylight is too old."""
    try:
        from raylight.distributed_modules.inner_attention import INNER_ATTENTION_KEY, set_inner_attention
    except ImportError as err:
        raise RuntimeError(
            "Adaptive sparse attention under Raylight's sequence parallelism needs Raylight's inner-attention "
            "interface (raylight.distributed_modules.inner_attention), which this Raylight does not have: update "
            f"Raylight ({err})") from err
    return INNER_ATTENTION_KEY, set_inner_attention


def patch_worker_model(model_patcher: Any, config: SparseConfig) -> Any:
    """A clone of a Raylight worker's H3 ModelPatcher that runs adaptive sparse attention under `config`.

    Raises ValueError for a ring degree > 1 or a Ulysses degree that does not divide the heads.
    """
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    check_h3(diffusion_model)
    ulysses, ring = parallel_degrees()
    if ulysses == ring == 1:
        return apply_sparse_attention(model_patcher, config)
    heads = diffusion_model.blocks[0].attn.heads
    check_sequence_parallel(heads, ulysses, ring)
    key, set_inner_attention = inner_attention_slot()
    processor = RaylightSparseAttention(config, heads, ulysses)
    replaced = model_patcher.model_options.get("transformer_options", {}).get(key)
    if replaced is not None and not isinstance(replaced, RaylightSparseAttention):
        processor.tracker.log_once(f"replaces the inner attention set before it ({type(replaced).__name__})")
    # the blocks only mark the calls that run sparse; Raylight's attn.forward stays and calls the processor
    return install(set_inner_attention(model_patcher, processor), processor, swap=False)


def worker_patch(config: SparseConfig) -> Callable[[Any, Any], Any]:
    """The patch Raylight's ``ray_patch`` runs on every worker: (node, model_patcher) -> patched clone.

    It is a closure, so Ray's cloudpickle ships it by value: the workers import Raylight and
    ComfyUI, not ComfyUI's custom-node folders, so it loads this package from its folder under its
    own name before calling `patch_worker_model`.
    """
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}

    def patch(node: Any, model_patcher: Any) -> Any:
        import importlib.util
        import sys

        name = "adaptive_sparse_attention"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, os.path.join(package_dir, "__init__.py"),
                                                          submodule_search_locations=[package_dir])
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        package = sys.modules[name]
        from adaptive_sparse_attention.nodes.raylight import patch_worker_model as apply

        return apply(model_patcher, package.SparseConfig(**fields))

    return patch
