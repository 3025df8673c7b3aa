"""Cheap 8-bit routing scores: Hadamard-rotated, quantised block means.

The routing only needs the order of the pooled scores E = q_mean k_mean^T / sqrt(D), so the
block means can be multiplied in 8 bits. A few dimensions of the means carry most of their
magnitude; the orthonormal Hadamard rotation x -> x Hd / sqrt(D) spreads it over all dimensions
(and leaves every dot product unchanged), so one scale per row (its largest magnitude over the
code range: 127 for int8, 448 for fp8 e4m3) loses little. Scores are (codes_q codes_k^T *
scale_q) * scale_k with 1/sqrt(D) folded into scale_q.

- `int8`: the products are summed exactly (int32 on tensor cores; in fp32 here, where every
  partial sum is an integer below 2**24), so the torch path and the Triton kernel agree bit for
  bit. Tensor-core int8 runs on sm80 and later.
- `fp8` (e4m3): fp32 accumulation, so the kernel's summation order shows in the last bits; it
  needs sm89 or later (Ada, Hopper, Blackwell) on the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SparseAttentionError

FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


@dataclass(frozen=True)
class QuantisedMeans:
    """8-bit block means: codes [B, H, J, D] (int8 or float8_e4m3fn), fp32 scales [B, H, J]
    (the query scales include 1/sqrt(D))."""

    q_codes: torch.Tensor
    q_scale: torch.Tensor
    k_codes: torch.Tensor
    k_scale: torch.Tensor


def hadamard(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix [dim, dim] fp32 (dim a power of two), symmetric.
    Built on `device` by log2(dim) doublings in float64 (no copy from the host, which on the GPU
    would wait for it to drain)."""
    if dim < 1 or dim & (dim - 1):
        raise SparseAttentionError(f"hadamard: dim={dim} is not allowed: expected a power of two")
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / dim ** 0.5).to(torch.float32)


def quantise(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of fp32 x [..., D] rotated by `hadamard` and quantised with one scale per row:
    (codes [..., D] in the format's dtype, fp32 scale [...]); code * scale ~ rotated x."""
    if fmt not in FORMATS:
        raise SparseAttentionError(f"quantise: fmt={fmt!r} is not allowed: expected one of {', '.join(FORMATS)}")
    dtype, top = FORMATS[fmt]
    rotated = x.float() @ hadamard(x.shape[-1], x.device)
    amax = rotated.abs().amax(-1)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))  # a zero row keeps zero codes
    unit = rotated / scale.unsqueeze(-1)
    codes = unit.round().clamp(-top, top).to(dtype) if fmt == "int8" else unit.clamp(-top, top).to(dtype)
    return codes, scale


def quantise_means(q_mean: torch.Tensor, k_mean: torch.Tensor, fmt: str) -> QuantisedMeans:
    """`QuantisedMeans` of fp32 block means q_mean, k_mean [B, H, J, D]."""
    q_codes, q_scale = quantise(q_mean, fmt)
    k_codes, k_scale = quantise(k_mean, fmt)
    return QuantisedMeans(q_codes, q_scale * q_mean.shape[-1] ** -0.5, k_codes, k_scale)


def fp8_unavailable_reason(device: torch.device) -> str | None:
    """Why fp8 routing scores cannot run on `device` (a GPU before sm89), or None."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return (f"fp8 e4m3 routing scores need sm89 or later, {torch.cuda.get_device_name(device)} is "
                f"sm{''.join(map(str, torch.cuda.get_device_capability(device)))}")
    return None
