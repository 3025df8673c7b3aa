"""The sampled estimate of a sparse call's error: a few query blocks per head, exact against all keys.

Each call picks `strata` blocks of `rows` model-order rows per head in every sparse region (the target
video; reference videos too under ``joint-video`` scope; context rows never). A region's blocks are
split into `strata` contiguous ranges (early and late parts of the clip); in each range head h starts
h/H of the way along, so the heads of one call see different blocks spread over the range, and every
head moves by a stride coprime to the range's length per `rotation` (the caller's denoising step or
call counter), so each head visits every block of the range once in that many rotations. Edge blocks
keep their true length (the missing rows are masked, and marked -1 in `rows`).

The sampled rows run dense through torch SDPA against every key; the result is two per-head sums on
the device, sum |ours - exact|^2 and sum |exact|^2 over the sampled rows (and the batch), so a caller
adds them up over blocks and steps without a host synchronisation and reads the relative L2
sqrt(sum diff^2 / sum exact^2) once at the end. Everything is tensor arithmetic on rows built from
the layout's sizes and the rotation (no host read, no data-dependent branch), so it traces under
torch.compile.

Cost: `strata` x `rows` query rows per head and sparse region; the default (2 x 64 = 128 rows, one
128-row query tile per head) at H3 10 s (S 73,642, 56 heads of 128) is 0.27 TFLOP and one read of K
and V, about 1-2% of a sparse call (measured: BENCHMARKS.md, "The error estimate").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.segments import REFERENCE_VIDEO, TARGET_VIDEO, Segment
from .layout import SequenceLayout

ROWS = 64  # rows of a sampled block
STRATA = 2  # sampled blocks per head and sparse region in one call
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # successive rotations land far apart within a range


@dataclass(frozen=True)
class SampledError:
    """The sampled rows of one call and their per-head error sums (on the device, not read back).

    Attributes:
        rows: [H, n] int64 model-order rows sampled per head, -1 past a short edge block.
        sq_diff: [H] sum over the batch and sampled rows of |out - exact|^2 (float32, float64 for float64 q).
        sq_exact: [H] sum of |exact|^2 over the same rows.
    """

    rows: torch.Tensor
    sq_diff: torch.Tensor
    sq_exact: torch.Tensor

    def heads(self) -> torch.Tensor:
        """[H] relative L2 per head, sqrt(sq_diff / sq_exact) (0 where a head's exact rows are all zero)."""
        return (self.sq_diff / self.sq_exact.clamp_min(torch.finfo(self.sq_exact.dtype).tiny)).sqrt()

    def pooled(self) -> torch.Tensor:
        """0-dim relative L2 over all heads' sampled rows (on the device)."""
        return (self.sq_diff.sum() / self.sq_exact.sum().clamp_min(torch.finfo(self.sq_exact.dtype).tiny)).sqrt()


def sparse_regions(layout: SequenceLayout, scope: str) -> list[Segment]:
    """The segments whose query rows run sparse: the target video, and the reference videos under
    ``joint-video`` scope (`SparseConfig.sparse_scope`), in model order."""
    regions = (TARGET_VIDEO, REFERENCE_VIDEO) if scope == "joint-video" else (TARGET_VIDEO,)
    return [s for s in layout.segments if s.region in regions]


def coprime_stride(n: int) -> int:
    """A stride near GOLDEN * n that is coprime to n (1 for n <= 2), so k -> k * stride mod n visits
    every one of n blocks once in n steps, successive steps far apart."""
    stride = max(1, round(GOLDEN * n))
    while math.gcd(stride, n) != 1:
        stride += 1
    return stride


def strata_of(layout: SequenceLayout, scope: str, rows: int = ROWS, strata: int = STRATA
              ) -> list[tuple[int, int, int, int]]:
    """The ranges sampled blocks are drawn from: (first row of the segment, its length, first block of the
    range, blocks in the range) per non-empty stratum of every sparse region, in model order.

    A segment of L rows has ceil(L / rows) blocks (the last one short); they split into `strata`
    contiguous ranges as equal as possible (fewer when the segment has fewer blocks).
    """
    out = []
    for seg in sparse_regions(layout, scope):
        blocks = -(-seg.length // rows)
        for s in range(strata):
            lo, hi = s * blocks // strata, (s + 1) * blocks // strata
            if hi > lo:
                out.append((seg.start, seg.length, lo, hi - lo))
    return out


def sample_rows(layout: SequenceLayout, heads: int, rotation: int, scope: str, device: torch.device | str = "cpu",
                rows: int = ROWS, strata: int = STRATA) -> torch.Tensor:
    """The model-order rows each head samples at `rotation` (deterministic; see the module docstring).

    Args:
        layout: the sequence.
        heads: H.
        rotation: the caller's step or call counter (any int; the same value gives the same rows).
        scope: `SparseConfig.sparse_scope`.
        device: where the rows are built (with device arithmetic only: nothing is copied from the host).
        rows: rows of a sampled block.
        strata: blocks per head and sparse region.
    Returns:
        [H, n] int64, n = rows x (number of strata); -1 past the end of a short edge block.
    """
    h = torch.arange(heads, device=device)
    within = torch.arange(rows, device=device)
    parts = []
    for start, length, lo, n in strata_of(layout, scope, rows, strata):  # a few ranges, never one per head
        shift = rotation % n * coprime_stride(n) % n  # no int(): a traced SymInt stays symbolic
        block = lo + (h * n // heads + shift) % n  # [H]
        offset = block.view(-1, 1) * rows + within  # [H, rows] rows into the segment
        parts.append(torch.where(offset < length, offset + start, -1))
    if not parts:
        return torch.zeros(heads, 0, dtype=torch.long, device=device)
    return torch.cat(parts, dim=1)


def exact_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Dense attention of the query rows `rows` [H, n] (model order, -1 read as row 0) of q against
    every key of k, v [B, H, S, D], scaled by D ** -0.5 as the engine is.

    On CUDA in float16/bfloat16 SDPA runs on the tensors as stored (fp32 softmax and accumulation inside
    the fused kernel, the output rounded once to the input dtype: an upcast copy of K and V would cost
    more than the sparse call's budget allows); elsewhere it computes in float32, float64 for float64 q.

    Returns:
        [B, H, n, D] in the compute dtype (float32, float64 for float64 q).
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, _, D = q.shape
    index = rows.clamp_min(0).view(1, H, -1, 1).expand(B, H, rows.shape[1], D)
    qs = q.gather(2, index)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return F.scaled_dot_product_attention(qs, k, v).to(acc)
    return F.scaled_dot_product_attention(qs.to(acc), k.to(acc), v.to(acc))


def sampled_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layout: SequenceLayout,
                  rotation: int = 0, scope: str = "target-video", rows: int = ROWS, strata: int = STRATA
                  ) -> SampledError:
    """The sampled estimate of the error of a sparse call's output on its sparse (video) rows.

    Args:
        q, k, v: the call's inputs [B, H, S, D], model order.
        out: the sparse output [B, H, S, D], model order.
        layout: the sequence (which rows are video).
        rotation: the caller's step or call counter: moves the sampled blocks (`sample_rows`).
        scope: `SparseConfig.sparse_scope` (which video regions are sparse).
        rows, strata: rows of a sampled block; blocks per head and sparse region.
    Returns:
        The rows and per-head sums (`SampledError`), computed without any host synchronisation.
    """
    B, H, _, D = q.shape
    picked = sample_rows(layout, H, rotation, scope, q.device, rows, strata)
    exact = exact_rows(q, k, v, picked)
    index = picked.clamp_min(0).view(1, H, -1, 1).expand(B, H, picked.shape[1], D)
    ours = out.gather(2, index).to(exact.dtype)
    valid = (picked >= 0).view(1, H, -1, 1).to(exact.dtype)
    sq_diff = ((ours - exact) * valid).pow(2).sum(dim=(0, 2, 3))
    sq_exact = (exact * valid).pow(2).sum(dim=(0, 2, 3))
    return SampledError(picked, sq_diff, sq_exact)
