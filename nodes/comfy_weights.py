"""Weights and allocations through ComfyUI: casting (LoRA, offload, quantised weights), layers whose
class brings its own cast or forward (GGUF, other packs' ops), the allocation graph, and KJNodes'
low-VRAM calling conventions."""
from __future__ import annotations

import dataclasses
import itertools
import sys
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from ..backend.producer import CHUNK_ROWS, Projection, head_rows

FP8_LAYOUTS = ("TensorCoreFP8Layout", "TensorCoreFP8E4M3Layout", "TensorCoreFP8E5M2Layout")
HOST_PACKAGES = ("comfy", "torch")  # whose op classes the producer reads through ComfyUI's own cast


def class_name(module: torch.nn.Module) -> str:
    """A layer's class as "module.qualname", for messages."""
    return f"{type(module).__module__}.{type(module).__qualname__}"


def own_method(module: torch.nn.Module, name: str) -> type | None:
    """The class outside ComfyUI and torch that defines the method `name` as this layer resolves it
    (GGUF's GGMLLayer for ``cast_bias_weight``), or None when ComfyUI or torch defines it (or nobody)."""
    for cls in type(module).__mro__:
        if name in vars(cls):
            return None if cls.__module__.split(".")[0] in HOST_PACKAGES else cls
    return None


def weight_path(module: torch.nn.Module) -> str:
    """How the producer reads a Linear: "forward" (its class's own forward, on each chunk of rows),
    "cast" (its class's own ``cast_bias_weight``, once per call: GGUF's GGMLOps, whose forward is
    ComfyUI's Linear dispatching to that cast) or "comfy" (ComfyUI's cast and quantised fast paths,
    or plain torch). A class's own cast is not used where ComfyUI's weight or bias functions (an
    on-the-fly LoRA) are set, since its forward may apply them elsewhere: the forward is."""
    if own_method(module, "forward") is not None:
        return "forward"
    if own_method(module, "cast_bias_weight") is not None:
        functions = len(getattr(module, "weight_function", ())) + len(getattr(module, "bias_function", ()))
        return "forward" if functions else "cast"
    if own_method(module, "forward_comfy_cast_weights") is not None:
        return "forward"
    return "comfy"


def checked(module: torch.nn.Module, weight: Any, bias: Any, source: str) -> tuple[torch.Tensor, Any]:
    """(weight, bias) when they are floating tensors whose storage has the layer's shape, else a clear
    error: a weight in a format of its own (e.g. GGUF's quantised bytes under ComfyUI's plain cast,
    whose `shape` reports the layer's shape while its storage holds blocks of bytes) must never be
    multiplied as if it were the layer's weight.

    Args:
        module: the Linear they belong to (its in_features / out_features when it has them).
        weight, bias: what `source` handed back.
        source: where they came from, for the message (e.g. "ComfyUI's cast_bias_weight").
    Returns:
        (weight, bias) unchanged.
    """
    rows = getattr(module, "out_features", None)
    cols = getattr(module, "in_features", None)
    expected = (rows, cols) if rows is not None and cols is not None else None

    def refuse(why: str) -> RuntimeError:
        return RuntimeError(f"cannot read the weights of a {class_name(module)} layer: {source} {why}. A layer "
                            f"class that stores its weight in a format of its own must bring its own "
                            f"cast_bias_weight or forward (as ComfyUI-GGUF's GGMLOps does)")

    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or len(weight.size()) != 2:
        raise refuse(f"returned a {type(weight).__name__} of dtype {getattr(weight, 'dtype', None)} and storage "
                     f"shape {tuple(weight.size()) if isinstance(weight, torch.Tensor) else None}, not a 2-D "
                     f"floating tensor")
    if tuple(weight.size()) != (expected or tuple(weight.shape)):
        raise refuse(f"returned a {type(weight).__name__} whose storage has shape {tuple(weight.size())}, "
                     f"expected {expected or tuple(weight.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or not bias.is_floating_point()
                             or tuple(bias.size()) != (weight.size(0),)):
        raise refuse(f"returned a bias {type(bias).__name__} of shape "
                     f"{tuple(bias.size()) if isinstance(bias, torch.Tensor) else None}, expected ({weight.size(0)},)")
    return weight, bias


@contextmanager
def linear_weights(module: torch.nn.Module, like: torch.Tensor) -> Iterator[tuple[torch.Tensor, Any]]:
    """(weight, bias) of a Linear in `like`'s dtype and device, as the layer multiplies by them.

    A class with its own ``cast_bias_weight`` (GGUF) is asked through it, as its forward asks;
    ComfyUI layers go through `comfy.ops.cast_bias_weight`, which dequantises, applies LoRA weight
    functions and handles offloaded weights; plain torch layers are cast directly. The result is
    checked (`checked`); a comfy-kitchen QuantizedTensor is handed back as the cast returns it.
    """
    if own_method(module, "cast_bias_weight") is not None:
        cast = module.cast_bias_weight(like)
        if not isinstance(cast, (tuple, list)) or len(cast) != 2:
            raise RuntimeError(f"cannot read the weights of a {class_name(module)} layer: its own cast_bias_weight "
                               f"returned a {type(cast).__name__}, expected a (weight, bias) pair")
        yield checked(module, *cast, f"its own {type(module).__name__}.cast_bias_weight")
        return
    if not hasattr(module, "comfy_cast_weights"):
        bias = None if module.bias is None else module.bias.to(like)
        yield checked(module, module.weight.to(like), bias, "its weight cast to the input's dtype")
        return
    import comfy.ops

    if not hasattr(comfy.ops, "CastBiasWeightContext"):  # older ComfyUI: no offload-aware context yet
        yield readable(module, *comfy.ops.cast_bias_weight(module, like))
        return
    with comfy.ops.CastBiasWeightContext(module, like, offloadable=True) as (weight, bias):
        yield readable(module, weight, bias)


def readable(module: torch.nn.Module, weight: Any, bias: Any) -> tuple[Any, Any]:
    """What ComfyUI's cast returned, checked unless it is a comfy-kitchen QuantizedTensor (its own format)."""
    if hasattr(weight, "_layout_cls"):
        return weight, bias
    return checked(module, weight, bias, "ComfyUI's cast_bias_weight")


@contextmanager
def qkv_projection(module: torch.nn.Module, x: torch.Tensor, num_heads: int, head_dim: int) -> Iterator[Projection]:
    """The fused qkv projection `module` as the layer itself multiplies x, for the producer.

    A layer whose class brings its own forward goes through that forward on each chunk of rows
    (`ForwardProjection`), its ``cast_bias_weight`` run once for them all (`casting_once`); one whose class
    brings its own ``cast_bias_weight`` (GGUF's GGMLOps:
    dequantisation and LoRA patches inside) through that cast, once per call (`weight_path`).
    ComfyUI's own layers mirror the inference path of its mixed-precision Linear: a quantised weight
    whose format quantises activations (fp8, nvfp4, mxfp8) gets each chunk of rows quantised as the
    layer quantises its whole input (same layout, same input scale; nvfp4's per-tensor scale is
    taken over all of x), an int8 weight multiplies the rows as they are (comfy-kitchen's int8
    linear quantises them per row), and the weight is fetched with the same cast flags ComfyUI
    passes (re-quantisation after an on-the-fly LoRA of a streamed layer). Everything else (plain
    layers, formats this device does not multiply in, weight patches) gets the weight ComfyUI's
    cast hands back, dequantised once per call. A weight none of these can read raises, naming the
    layer's class (`checked`). Yields a `Projection` (backend/producer.py).
    """
    path = weight_path(module)
    if path == "forward":
        with casting_once(module):
            yield ForwardProjection(module, num_heads, head_dim)
        return
    layout = getattr(module, "layout_type", None)
    if path == "cast" or layout is None:  # a class's own cast, any other ComfyUI op class, or plain torch
        with linear_weights(module, x) as (weight, bias):
            yield LayerProjection(weight, bias, num_heads, head_dim)
        return
    import comfy.model_management as mm
    import comfy.ops
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor

    pre = getattr(module, "pre_quant_scale", None)
    pre = None if pre is None else mm.cast_to_device(pre, x.device, x.dtype)
    quantised = not (getattr(module, "_full_precision_mm", False) or getattr(module, "comfy_force_cast_weights", False)
                     or len(module.weight_function) > 0 or len(module.bias_function) > 0)
    quantize_input = QUANT_ALGOS.get(getattr(module, "quant_format", None), {}).get("quantize_input", True)
    if quantised and quantize_input:
        scale = getattr(module, "input_scale", None)
        scale = activation_scale(x, layout, pre) if scale is None else mm.cast_to_device(scale, x.device, None)
        with comfy.ops.CastBiasWeightContext(module, None, dtype=x.dtype, device=x.device, bias_dtype=x.dtype,
                                             offloadable=True, compute_dtype=x.dtype, want_requant=True) as (w, b):
            yield LayerProjection(w, b, num_heads, head_dim, pre, layout, scale)
    elif quantised and isinstance(module.weight, QuantizedTensor):  # int8 family: weight-only quantised layout
        with comfy.ops.CastBiasWeightContext(module, None, dtype=module.weight.dtype, device=x.device,
                                             bias_dtype=x.dtype, offloadable=True, compute_dtype=x.dtype,
                                             want_requant=True) as (w, b):
            yield LayerProjection(w.to(dtype=x.dtype), b, num_heads, head_dim, pre)
    else:  # ComfyUI multiplies in float: a weight the cast hands back quantised is dequantised once, here
        with linear_weights(module, x) as (weight, bias):
            weight = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
            yield LayerProjection(weight, bias, num_heads, head_dim, pre)


@contextmanager
def casting_once(module: torch.nn.Module) -> Iterator[None]:
    """While inside, the layer's ``cast_bias_weight`` method (GGUF's: the weight fetched to the device,
    dequantised and patched) runs once per dtype and device and its (weight, bias) is handed to every later
    call: the forward path calls the layer's forward once per chunk of rows and head group, and each call
    would cast again (with streamed weights, fetch the weight again). A layer without that method (its
    forward reads its weight another way) is left as it is; the method is its own again on leaving."""
    cast = getattr(module, "cast_bias_weight", None)
    if not callable(cast) or "cast_bias_weight" in vars(module):
        yield
        return
    kept: dict[tuple, Any] = {}

    def once(input: Any = None, dtype: Any = None, device: Any = None, bias_dtype: Any = None, **rest: Any) -> Any:
        key = (getattr(input, "dtype", None), getattr(input, "device", None), dtype, device, bias_dtype,
               tuple(sorted(rest.items())))
        if key not in kept:
            kept[key] = cast(input, dtype=dtype, device=device, bias_dtype=bias_dtype, **rest)
        return kept[key]

    module.cast_bias_weight = once
    try:
        yield
    finally:
        del module.cast_bias_weight


class ForwardProjection:
    """A layer whose class brings its own forward: that forward on each chunk of rows, as the layer
    computes its whole input (weights cast, dequantised and patched however its class does). A head
    group takes its columns of the forward's output, so with several groups each chunk is
    projected once per group; the output's shape is checked on every call."""

    def __init__(self, module: torch.nn.Module, num_heads: int, head_dim: int):
        self.module, self.num_heads, self.head_dim = module, num_heads, head_dim

    def for_heads(self, heads: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
        width = 3 * self.num_heads * self.head_dim
        columns: list[torch.Tensor] = []  # the group's columns, made once on the output's device

        def project(rows: torch.Tensor) -> torch.Tensor:
            out = self.module(rows)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows.shape[0], width):
                raise RuntimeError(f"cannot read the qkv projection of a {class_name(self.module)} layer: its own "
                                   f"forward returned {getattr(out, 'shape', type(out).__name__)} for rows of shape "
                                   f"{tuple(rows.shape)}, expected ({rows.shape[0]}, {width})")
            if heads == (0, self.num_heads):
                return out
            if not columns:
                columns.append(head_rows(torch.arange(width, device=out.device), self.num_heads, self.head_dim,
                                         heads))
            return out.index_select(1, columns[0])
        return project


def activation_scale(x: torch.Tensor, layout: str, pre: torch.Tensor | None) -> torch.Tensor | None:
    """The input scale ComfyUI's layer uses when quantising all of x at once: for nvfp4 the tensor's
    absolute maximum over the fp4 x fp8 range (taken chunk by chunk, exact, so no full-size copy of x
    is made); for fp8 the 1 its layout makes when given none, made once here instead of once per chunk
    (the producer's chunks are host-bound on Hopper: BENCHMARKS.md, quantised checkpoints); None where
    the scale is per block (mxfp8)."""
    if layout in FP8_LAYOUTS:
        return torch.ones((), device=x.device, dtype=torch.float32)
    if layout != "TensorCoreNVFP4Layout":
        return None
    from comfy_kitchen.float_utils import F4_E2M1_MAX, F8_E4M3_MAX

    peak = torch.stack([(x[a:a + CHUNK_ROWS] if pre is None else x[a:a + CHUNK_ROWS] * pre).abs().amax()
                        for a in range(0, x.shape[0], CHUNK_ROWS)]).amax()
    return peak / (F8_E4M3_MAX * F4_E2M1_MAX)


class LayerProjection:
    """A ComfyUI layer's fused qkv weight (possibly a comfy-kitchen QuantizedTensor) and how the
    layer treats its input: an elementwise pre-scale (AWQ smoothing) and the activation layout
    and scale when the format quantises activations. A head group's rows are sliced out of the
    stored quantised data and its scales; a layout that cannot be sliced is dequantised once per
    call, on the first head group that needs it (and only then)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int, head_dim: int,
                 pre: torch.Tensor | None = None, layout: str | None = None, scale: torch.Tensor | None = None):
        self.weight, self.bias, self.num_heads, self.head_dim = weight, bias, num_heads, head_dim
        self.pre, self.layout, self.scale = pre, layout, scale
        self.dequantised: torch.Tensor | None = None

    def for_heads(self, heads: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
        w = self.weight
        if heads != (0, self.num_heads):
            index = head_rows(torch.arange(w.shape[0], device=w.device), self.num_heads, self.head_dim, heads)
            w = quantised_rows(w, index)
            if w is None:
                if self.dequantised is None:
                    self.dequantised = self.weight.dequantize()
                w = self.dequantised.index_select(0, index)
        b = None if self.bias is None else head_rows(self.bias, self.num_heads, self.head_dim, heads)
        if self.pre is None and self.layout is None:
            return lambda rows: F.linear(rows, w, b)
        return lambda rows: F.linear(self.quantise(rows), w, b)

    def quantise(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows as the layer's forward hands them to its matmul."""
        if self.pre is not None:
            rows = rows * self.pre
        if self.layout is None:
            return rows
        from comfy.quant_ops import QuantizedTensor

        return QuantizedTensor.from_float(rows, self.layout, scale=self.scale)


def quantised_rows(weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor | None:
    """Rows `index` of a weight as a weight of the same kind: a plain tensor's rows, or a
    QuantizedTensor built from the stored data's rows and their scales (int8 tensor- or row-wise
    incl. convrot: scales per row or one; fp8: one scale; nvfp4: its swizzled block scales
    unswizzled, selected and swizzled again). None for a layout or state that cannot be sliced
    (transposed views, other layouts)."""
    if not hasattr(weight, "_layout_cls"):  # a plain tensor (comfy-kitchen's QuantizedTensor carries its layout)
        return weight.index_select(0, index)
    from comfy.quant_ops import QuantizedTensor

    p, kind = weight._params, weight._layout_cls
    if getattr(p, "transposed", False) or len(p.orig_shape) != 2:
        return None
    shape = (index.numel(), p.orig_shape[1])
    if kind == "TensorWiseINT8Layout":
        scale = p.scale if p.scale.numel() == 1 else p.scale.index_select(0, index)
        return QuantizedTensor(weight._qdata.index_select(0, index), kind,
                               dataclasses.replace(p, scale=scale, orig_shape=shape))
    if kind in FP8_LAYOUTS and p.scale.numel() == 1:
        return QuantizedTensor(weight._qdata.index_select(0, index), kind, dataclasses.replace(p, orig_shape=shape))
    if kind == "TensorCoreNVFP4Layout":
        from comfy_kitchen.float_utils import from_blocked, roundup, to_blocked

        rows, cols = weight._qdata.shape[0], weight._qdata.shape[1] * 2 // 16
        blocks = from_blocked(p.block_scale, rows, cols).index_select(0, index)
        pad = roundup(index.numel(), 16) - index.numel()  # the layout keeps rows padded to 16
        qdata = F.pad(weight._qdata.index_select(0, index), (0, 0, 0, pad))
        blocks = F.pad(blocks.view(torch.uint8), (0, 0, 0, pad))
        blocks = to_blocked(blocks.view(p.block_scale.dtype), flatten=False)
        return QuantizedTensor(qdata, kind, dataclasses.replace(p, block_scale=blocks, orig_shape=shape))
    return None


def outside_allocation_graph() -> Any:
    """A context that keeps our allocations out of ComfyUI's allocation graph, where it has one.

    Current ComfyUI records the allocations of an H3 forward on CUDA and replays them
    (``comfy.model_prefetch.pause_malloc_graph``, its "model compiler"); its own sparse node pauses
    that for what outlives a call. The engine keeps tiling, routing and reblock tensors across
    calls, so the whole sparse path and the kernel preparation run paused. Older ComfyUI has no
    such graph, and under torch.compile there is nothing to pause at trace time.
    """
    pause = getattr(sys.modules.get("comfy.model_prefetch"), "pause_malloc_graph", None)
    if pause is None or torch.compiler.is_compiling():
        return nullcontext()
    return pause()


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small parameter (norm weight) on `device`, through ComfyUI's cast when it is loaded."""
    mm = sys.modules.get("comfy.model_management")
    return mm.cast_to(t, device=device) if mm is not None else t.to(device)


def head_groups(heads: int, chunks: Any) -> list[tuple[int, int]]:
    """Split heads into `chunks` near-equal groups (KJNodes' ``minimax_head_chunks``)."""
    n = max(1, min(int(chunks) if isinstance(chunks, int) else 1, heads))
    sizes = [heads // n + (1 if i < heads % n else 0) for i in range(n)]
    bounds = list(itertools.accumulate([0] + sizes))
    return list(zip(bounds[:-1], bounds[1:]))



def unwrap_input(x: Any) -> torch.Tensor:
    """KJNodes' low-VRAM block forward hands the attention input in a one-item list to free it early."""
    return x.pop() if isinstance(x, list) else x


