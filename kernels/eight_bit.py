"""The 8-bit arithmetic of the exact loop over the selected key blocks, which two families implement:
the torch reference (`reference/quantise.py`, `reference/reference.py`, the oracle) and the Triton
kernel (`triton/block_quantise.py`, `triton/attention.py`). Here: its formats, scales and the shapes
of the quantised blocks. Every step is fp32 arithmetic in the kernel's order, so the two agree bit for bit.

Per call, in tiled order (`plan.pack`), per (batch, head):
- K is smoothed: the head's key mean over its rows (fp32) is subtracted from every key. That shifts
  the logits of a query row by one constant, q . mean, which the kernel adds back (`q_shift`), so
  the exact keys, the dense prefix and the summaries still share one softmax.
- Q and smoothed K are rotated by the same Hadamard matrix (unnormalised: +-1 entries, applied by
  log2(D) butterflies of exact-order fp32 adds), which leaves q . k times D and spreads an outlier
  channel over all channels; then INT8 codes, one scale per block (its largest magnitude / 127,
  Q's also / D), rounded half away from zero.
- V: one scale per channel of the head (its largest magnitude over the head's rows), so the scales
  leave the loop: FP8 e4m3 codes (magnitude up to 448) or INT8 codes (up to 127). Stored transposed
  [D, L] so that P.V reads V along its reduction dimension, as 8-bit MMA wants.
- P (in the kernel, per key tile of block_n rows, `triton/attention.py` `_quantised_keys`): FP8 codes of
  256 exp2(s - ref), ref the running max of the picks' tile maxima (floating codes keep their
  relative precision however small p gets); INT8 codes round(127 exp2(s - the tile's own max))
  (unsigned values on a uniform grid, which needs the tile's own range; Triton's tl.dot takes one
  dtype for both operands, so no u8 x s8), their product weighted by exp2(tile max - ref). The
  sums of p and the accumulation across tiles are fp32, outside the MMA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CODE_TOP = 127.0  # INT8 codes of Q, K (and V on the int8 path)
FP8_TOP = 448.0  # largest e4m3 magnitude
P_SCALE = {"fp8": 256.0, "int8": 127.0}  # p' in (0, 1] -> codes
V_TOP = {"fp8": FP8_TOP, "int8": CODE_TOP}
PV_FORMATS = tuple(P_SCALE)
PRECISIONS = ("bf16", "8-bit")  # what the kernels take: bf16 is the inputs' own precision


@dataclass(frozen=True)
class QuantisedBlocks:
    """Q, K, V of some heads in 8 bits, tiled order (L = J * block_size slots, zero in padding).

    q_codes, k_codes: int8 [B, h, L, D] (rotated); q_scale, k_scale: fp32 [B, h, J]; q_shift: fp32 [B, h, L],
    q . key mean of every query slot; v_codes: int8 or float8_e4m3fn [B, h, D, L] (transposed);
    v_scale: fp32 [B, h, J, D]."""

    q_codes: torch.Tensor
    q_scale: torch.Tensor
    q_shift: torch.Tensor
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor


def key_mean(k: torch.Tensor) -> torch.Tensor:
    """fp32 [B, H, D]: the mean key of every (batch, head) over its S rows (the smoothing of K)."""
    return k.mean(2, dtype=torch.float32)


def value_max(v: torch.Tensor) -> torch.Tensor:
    """fp32 [B, H, D]: V's largest magnitude per channel of every (batch, head) (V's scales)."""
    return torch.maximum(v.amax(2), -v.amin(2)).float()
