"""Quantised H3 checkpoints built with ComfyUI's own quantisation functions.

A float state dict of the DiT becomes the checkpoint a user downloads: every Linear weight of
the DiT blocks (attention qkv/out, MLP) is quantised by comfy-kitchen's layouts as ComfyUI
registers them (`comfy.quant_ops`), stored as ComfyUI's loader reads it (the quantised data,
its scales, a `<layer>.comfy_quant` JSON tensor per layer); everything else stays as it was.
The formats are the ones H3 checkpoints are published in, plus int8 row-wise (int8 without
the rotation) for the tests.
"""
from __future__ import annotations

import json
import re

import torch

# format name -> (ComfyUI layout, its quantise arguments, the layer's comfy_quant entry); the group
# size of convrot is filled in per checkpoint (256 in published checkpoints)
FORMATS = {
    "int8_convrot": ("TensorWiseINT8Layout", dict(per_channel=True, convrot=True),
                     {"format": "int8_tensorwise", "convrot": True}),
    "int8_rowwise": ("TensorWiseINT8Layout", dict(per_channel=True), {"format": "int8_tensorwise"}),
    "fp8": ("TensorCoreFP8E4M3Layout", dict(scale="recalculate"), {"format": "float8_e4m3fn"}),
    "nvfp4": ("TensorCoreNVFP4Layout", dict(scale="recalculate"), {"format": "nvfp4"}),
}
WEIGHTS = ("bf16", "int8_convrot", "fp8", "nvfp4")  # what the e2e benchmark offers
QUANTISED = re.compile(r"^blocks\.\d+\.(attn\.(qkv_proj|out_proj)|mlp\.(fc1|fc2))\.weight$")


def quantise_state_dict(sd: dict[str, torch.Tensor], fmt: str, convrot_groupsize: int = 256,
                        dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """`sd` (an H3 DiT state dict, ComfyUI's key names) with its block Linear weights in `fmt`.

    Args:
        sd: float state dict; not modified.
        fmt: a key of FORMATS.
        convrot_groupsize: rotation group size of int8_convrot (must divide the layers' input width).
        dtype: the float type the weights are quantised from (published checkpoints: bf16).
    Returns:
        a new state dict ComfyUI's UNETLoader loads as a mixed-precision model.
    """
    if fmt not in FORMATS:
        raise ValueError(f"quantise_state_dict: fmt={fmt!r} is not a format; allowed: {', '.join(FORMATS)}")
    from comfy.quant_ops import QuantizedTensor

    layout, kwargs, conf = FORMATS[fmt]
    if kwargs.get("convrot"):
        kwargs, conf = dict(kwargs, convrot_groupsize=convrot_groupsize), dict(conf, convrot_groupsize=convrot_groupsize)
    out = {}
    for key, t in sd.items():
        if not QUANTISED.match(key):
            out[key] = t
            continue
        qt = QuantizedTensor.from_float(t.to(dtype), layout, **kwargs)
        out.update({k: v.contiguous() for k, v in qt.state_dict(key).items()})
        out[key.removesuffix("weight") + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    if len(out) == len(sd):
        raise ValueError("quantise_state_dict: the state dict has no DiT block Linear weights (blocks.N.attn/mlp)")
    return out


def unsupported(weights: str, device: torch.device) -> str | None:
    """Why ComfyUI on `device` would not multiply in `weights` (it would dequantise the weight on
    every call instead, so the run would not measure what users of that format get), or None."""
    if weights not in WEIGHTS:
        return f"--weights {weights!r} is not a checkpoint format; allowed: {', '.join(WEIGHTS)}"
    need = {"fp8": ((8, 9), "fp8 matmuls need sm89 or newer"),
            "nvfp4": ((10, 0), "nvfp4 matmuls need sm100 or newer"),
            "int8_convrot": ((7, 5), "int8 matmuls need sm75 or newer")}.get(weights)
    if need is None:
        return None
    if device.type != "cuda":
        if weights == "int8_convrot":
            return None  # comfy-kitchen's int8 linear runs on the CPU (eager)
        return f"--weights {weights}: {need[1]}; the CPU has none, so ComfyUI would dequantise every call"
    cap = torch.cuda.get_device_capability(device)
    if cap < need[0]:
        return (f"--weights {weights}: {need[1]}; this GPU is sm{cap[0]}{cap[1]}, so ComfyUI would dequantise "
                f"the weight on every call")
    return None
