"""The reblock metric: features under which tokens that want the same keys lie close.

Two queries want the same keys when their logit profiles K q_i and K q_j point the same way;
<K q_i, K q_j> = q_i^T K^T K q_j, so queries are compared by the cosine of q^T L_K with
L_K L_K^T = M_K = K^T K / N (uncentered second moment of the keys, plus a small ridge relative
to trace/d), and keys by the cosine of k^T L_Q. Moments are estimated per (batch, head) from an
evenly strided sample of the region's rows; the factor is a Cholesky factor (`cholesky_ex`, no
host sync). The small moment, factor and basis math runs in float64 and a failed factorization
falls back to the diagonal factor: in float32 the factorization failed on the GPU for most heads
of a structured scene, which turned their features into zeros and their blocks into raster order.

Features are normalised in the full head dimension, then projected on their top `FEATURE_DIMS`
principal directions (subspace iteration, per head) and stored in half precision (unit-scale
coordinates); the tree computes with them in float32 on every device, so a tiling does not
depend on where it is built.
"""
from __future__ import annotations

import torch

from ..kernels.reference.reblock_reference import TINY
from ..kernels.registry import Kernels, or_reference
from .cache import ShapeCache
from .reblock_graphs import replayed

MOMENT_SAMPLES = 8192  # rows per (batch, head) used to estimate moments and the feature basis
RIDGE = 1e-3  # ridge added to the second moment, relative to trace / d
FEATURE_DIMS = 16  # principal directions of the normalised features kept for the tree
BASIS_ITERATIONS = 4  # subspace iterations for those directions


def ridge(m: torch.Tensor, relative: float) -> torch.Tensor:
    """m [..., n, n] plus (relative * trace / n + TINY) * I."""
    n = m.shape[-1]
    tr = m.diagonal(dim1=-2, dim2=-1).sum(-1)
    return m + (relative * tr / n + TINY).unsqueeze(-1).unsqueeze(-1) * torch.eye(n, dtype=m.dtype, device=m.device)


def cholesky_factor(m: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of symmetric PSD m [..., n, n], or the diagonal factor sqrt(diag m)
    (non-finite entries 0) where the factorization fails or is not finite; no host sync
    (`cholesky_ex`, then a select), so a failure can never hand on garbage or NaN."""
    L, info = torch.linalg.cholesky_ex(m)
    ok = (info == 0) & torch.isfinite(L).all(-1).all(-1)
    root = m.diagonal(dim1=-2, dim2=-1).clamp_min(0).sqrt()
    fallback = torch.diag_embed(torch.nan_to_num(root, nan=0.0, posinf=0.0))
    return torch.where(ok.unsqueeze(-1).unsqueeze(-1), L, fallback)


def orthonormalize(y: torch.Tensor) -> torch.Tensor:
    """Columns of y [..., n, r] made orthonormal by a shifted Cholesky QR (no host sync)."""
    g = ridge(y.transpose(-1, -2) @ y, 1e-4)  # the shift keeps rank-deficient y factorizable
    return torch.linalg.solve_triangular(cholesky_factor(g), y.transpose(-1, -2), upper=False).transpose(-1, -2)


def principal_basis(c: torch.Tensor, rank: int) -> torch.Tensor:
    """Top-`rank` eigenvector basis of symmetric PSD c [G, n, n] by subspace iteration: [G, n, rank]."""
    n = c.shape[-1]
    c = c / (c.diagonal(dim1=-2, dim2=-1).sum(-1) + TINY).view(-1, 1, 1)
    # deterministic dense start (no generator state): a fixed quasi-random matrix
    i = torch.arange(n, dtype=c.dtype, device=c.device).view(n, 1)
    j = torch.arange(rank, dtype=c.dtype, device=c.device).view(1, rank)
    y = torch.cos(0.7548776662 * (i + 1) * (j + 1) + 0.5698402910 * i)
    for _ in range(BASIS_ITERATIONS):
        y = orthonormalize(c @ y)
    return orthonormalize(y)


def metric_features(x: torch.Tensor, other: torch.Tensor, kernels: Kernels | None = None,
                    cache: ShapeCache | None = None) -> torch.Tensor:
    """Tree features of rows x [G, N, D] under the metric of `other` [G, N, D]: [G, N, r] in
    `feature_dtype(x)`, on every device alike.

    Rows of x L (L L^T = other^T other / N + ridge) are normalised in the full dimension, then
    projected on their top r principal directions, estimated from the strided sample. The small
    moments, factor and basis ([G, D, D]) are factorized in float64, so the factorizations
    cannot fail by rounding (the ridge is far above the products' rounding). The products are
    the kernels' (`kernels.metric_gram`, `kernels.metric_project`): on Triton in x's dtype on
    tensor cores with fp32 accumulation, reading the strided sample in place; in torch in x's
    accumulation dtype. On the GPU, with the layout's `cache`, the factor and the basis (about 150 small
    float64 ops, bound by their launches) replay from CUDA graphs (`reblock_graphs.replayed`).
    """
    kernels = or_reference(kernels)
    N, D = x.shape[1], x.shape[2]
    rank = min(FEATURE_DIMS, D)
    step = -(-N // MOMENT_SAMPLES)  # an evenly strided sample of the rows, read in place
    sample, rows = other[:, ::step], x[:, ::step]
    factor = replayed(lambda g: cholesky_factor(ridge(g, RIDGE)), kernels.metric_gram(sample), cache, "metric_graph",
                      "factor")
    basis = replayed(lambda g: principal_basis(g, rank), kernels.metric_gram(rows, factor), cache, "metric_graph",
                     ("basis", rank))  # of the normalised rows' moment
    return kernels.metric_project(x, factor, factor @ basis)
