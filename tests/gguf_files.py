"""GGUF files of a state dict for the tests, written with the `gguf` package as ComfyUI-GGUF's tools would.

Which tensors are quantised follows ComfyUI-GGUF's `tools/convert.py` (and the llama.cpp quantiser
its README uses): 1-D tensors and tensors of at most 1,024 values stay F32; the others take the
requested type, and where their rows do not split into that type's blocks (Q4_K: 256 values, Q8_0:
32) they fall back to F16, as convert.py falls back on a `QuantError`.

`gguf.quants.quantize` (gguf 0.19.0) writes Q8_0 but has no Q4_K quantiser (only its dequantiser),
so `quantize_q4_k` packs Q4_K blocks here (`block_q4_K`: fp16 d and dmin, twelve bytes of 6-bit
scales and mins for eight sub-blocks of 32, 128 bytes of 4-bit quants); the tests check it against
gguf's own dequantiser. Its choice of scales is a plain min/max fit, not llama.cpp's search: a file
of the same format with a larger rounding error.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# What ComfyUI-GGUF's loader accepts as an image model's `general.architecture` at the pinned commit has
# no MiniMax-H3 entry; ComfyUI detects the model from its keys, and published H3 GGUF files that load with
# UnetLoaderGGUF carry "wan", a name on that list.
ARCH = "wan"
SMALL = 1024  # convert.py's QUANTIZATION_THRESHOLD: tensors of at most this many values stay F32


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k a multiple of 256) -> Q4_K bytes [n, k / 256 * 144], as `gguf.quants.quantize` lays them out."""
    n, k = rows.shape
    x = rows.astype(np.float32).reshape(-1, 8, 32)  # super-blocks of 8 sub-blocks of 32 values
    low = np.minimum(x.min(axis=-1), 0.0)
    step = (x.max(axis=-1) - low) / 15.0  # per sub-block: value = step * q - offset, q in 0..15
    d = (step.max(axis=-1) / 63.0).astype(np.float16)
    dmin = ((-low).max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(step / d32), 0, 63), 0).astype(np.uint8)
        mn = np.where(dmin32 > 0, np.clip(np.rint(-low / dmin32), 0, 63), 0).astype(np.uint8)
        scale = (d32 * sc)[..., None]
        q = np.where(scale > 0, np.clip(np.rint((x + (dmin32 * mn)[..., None]) / scale), 0, 15), 0).astype(np.uint8)
    packed = np.concatenate([
        (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
        (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=-1)
    quants = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2j (low nibbles) and 2j+1 (high)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, quants],
                            axis=-1)
    return blocks.reshape(n, k // 256 * 144)


def tensor_type(key: str, shape: tuple[int, ...], qtype: str):
    """The GGML type a tensor of this shape gets in a `qtype` file (see the module text)."""
    import gguf

    if len(shape) <= 1 or int(np.prod(shape)) <= SMALL:
        return gguf.GGMLQuantizationType.F32
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    return gguf.GGMLQuantizationType[qtype] if shape[-1] % block == 0 else gguf.GGMLQuantizationType.F16


def quantised(data: np.ndarray, kind) -> np.ndarray:
    """`data` in GGML type `kind`, as the file stores it."""
    import gguf

    if kind == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(data.reshape(-1, data.shape[-1])).reshape(*data.shape[:-1], -1)
    return gguf.quants.quantize(data, kind)


def write_gguf(state_dict: dict[str, torch.Tensor], path: Path, qtype: str) -> dict[str, str]:
    """Write `state_dict` (float tensors, ComfyUI's key names) as a GGUF file of `qtype` ("Q8_0", "Q4_K").

    Returns:
        {key: the GGML type name it was written in}.
    """
    import gguf

    writer = gguf.GGUFWriter(path=None, arch=ARCH)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    types = {}
    for key, tensor in state_dict.items():
        data = tensor.to(torch.float32).numpy()
        kind = tensor_type(key, data.shape, qtype)
        writer.add_tensor(key, quantised(data, kind), raw_dtype=kind)
        types[key] = kind.name
    writer.write_header_to_file(path=str(path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types
