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
import os
import re

import torch

from ..errors import SparseAttentionError

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


def quantise_tensor(key: str, t: torch.Tensor, fmt: str, convrot_groupsize: int = 256,
                    dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """One state-dict entry as `quantise_state_dict` stores it: ``{key: t}`` unless `key` is a DiT
    block Linear weight (`QUANTISED`), else the quantised data, its scales and the layer's
    ``<layer>.comfy_quant`` JSON marker, computed on `t`'s device.

    Args:
        key: the entry's name (ComfyUI's key names of the H3 DiT).
        t: its float tensor; not modified.
        fmt: a key of FORMATS.
        convrot_groupsize: rotation group size of int8_convrot (must divide the layer's input width).
        dtype: the float type the weight is quantised from (published checkpoints: bf16).
    Returns:
        the entries to store for `key`, in the order `quantise_state_dict` gives them.
    """
    layout, kwargs, conf = _format(fmt, convrot_groupsize, "quantise_tensor")
    if not QUANTISED.match(key):
        return {key: t}
    from comfy.quant_ops import QuantizedTensor

    qt = QuantizedTensor.from_float(t.to(dtype), layout, **kwargs)
    out = {k: v.contiguous() for k, v in qt.state_dict(key).items()}
    out[key.removesuffix("weight") + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    return out


def _format(fmt: str, convrot_groupsize: int, caller: str) -> tuple[str, dict, dict]:
    """(ComfyUI layout, quantise arguments, comfy_quant entry) of `fmt`, or ValueError naming the formats."""
    if fmt not in FORMATS:
        raise SparseAttentionError(f"{caller}: fmt={fmt!r} is not a format; allowed: {', '.join(FORMATS)}")
    layout, kwargs, conf = FORMATS[fmt]
    if kwargs.get("convrot"):
        kwargs, conf = dict(kwargs, convrot_groupsize=convrot_groupsize), dict(conf, convrot_groupsize=convrot_groupsize)
    return layout, kwargs, conf


def quantise_state_dict(sd: dict[str, torch.Tensor], fmt: str, convrot_groupsize: int = 256,
                        dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """`sd` (an H3 DiT state dict, ComfyUI's key names) with its block Linear weights in `fmt`
    (`quantise_tensor` on each entry).

    Args:
        sd: float state dict; not modified.
        fmt: a key of FORMATS.
        convrot_groupsize: rotation group size of int8_convrot (must divide the layers' input width).
        dtype: the float type the weights are quantised from (published checkpoints: bf16).
    Returns:
        a new state dict ComfyUI's UNETLoader loads as a mixed-precision model.
    """
    _format(fmt, convrot_groupsize, "quantise_state_dict")
    out = {}
    for key, t in sd.items():
        out.update(quantise_tensor(key, t, fmt, convrot_groupsize, dtype))
    if len(out) == len(sd):
        raise SparseAttentionError("quantise_state_dict: the state dict has no DiT block Linear weights (blocks.N.attn/mlp)")
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


# torch dtype -> safetensors' name of it (the ones H3 checkpoints and their quantised forms use)
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}
ENTRY_JSON_BYTES = 192  # bound on one header entry's JSON past its name (dtype, a 4-d shape, two offsets)


class SafetensorsWriter:
    """A .safetensors file written one tensor at a time, so that neither the host nor the device ever
    holds the whole checkpoint.

    The header space (`header_bytes`, see `header_bound`) is reserved at the start of the file and
    filled in by `close`, padded with spaces (whitespace JSON readers skip: safetensors, ComfyUI's
    own reader). Every tensor starts at an offset its element size divides, as `save_file` lays them
    out: a tensor whose byte size is not a multiple of 8 (a ``comfy_quant`` marker, a scalar scale)
    is held back and written at the end, largest element size first. The same tensors added in the
    same order give the same bytes. Use as a context manager: on an error the partial file is removed.
    """

    def __init__(self, path, header_bytes: int) -> None:
        self.path = str(path)
        self.reserved = -(-int(header_bytes) // 8) * 8
        self.entries: dict[str, dict] = {}
        self.held: list[tuple[str, torch.Tensor]] = []
        self.offset = 0
        self.file = open(self.path, "wb")
        self.file.seek(8 + self.reserved)

    def add(self, name: str, t: torch.Tensor) -> None:
        """Store `t` (a CPU tensor) as `name`; it may be freed once this returns (unless held back)."""
        if name in self.entries or any(name == held for held, _ in self.held):
            raise SparseAttentionError(f"SafetensorsWriter: {name!r} was added already")
        if t.device.type != "cpu":
            raise SparseAttentionError(f"SafetensorsWriter: {name!r} is on {t.device}; move it to the CPU first")
        if t.dtype not in SAFETENSORS_DTYPES:
            raise SparseAttentionError(f"SafetensorsWriter: {name!r} has dtype {t.dtype}; allowed: "
                             f"{', '.join(str(d) for d in SAFETENSORS_DTYPES)}")
        t = t.detach().contiguous()
        if t.numel() * t.element_size() % 8:
            self.held.append((name, t))
            return
        self._write(name, t)

    def _write(self, name: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if size:
            self.file.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self.entries[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self.offset, self.offset + size]}
        self.offset += size

    def close(self) -> None:
        """Write the held-back tensors and the header; the file is complete after this."""
        for name, t in sorted(self.held, key=lambda item: -item[1].element_size()):  # stable: added order
            self._write(name, t)
        self.held.clear()
        header = json.dumps(self.entries, separators=(",", ":")).encode()
        if len(header) > self.reserved:
            raise SparseAttentionError(f"SafetensorsWriter: the header needs {len(header)} bytes, {self.reserved} were "
                             "reserved (header_bytes)")
        self.file.seek(0)
        self.file.write(self.reserved.to_bytes(8, "little"))
        self.file.write(header + b" " * (self.reserved - len(header)))
        self.file.close()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self._discard()
            return
        try:
            self.close()
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        self.file.close()
        os.remove(self.path)


def header_bound(names, entries_per_name: int = 1) -> int:
    """Header bytes enough for `entries_per_name` entries under each of `names` (a quantised layer
    stores up to four: its data, two scales and its comfy_quant marker)."""
    return sum(entries_per_name * (len(name) + ENTRY_JSON_BYTES) for name in names) + 64
