"""Fused projection of the reblock tree features (CPU interpreter) against the torch path.

`metric_features` is run on the same inputs with and without the Triton kernel; both store the
features in fp16 (`reblock_reference.feature_dtype`). fp32 inputs: the kernel's products are full fp32
("ieee"), in another summation order, so features (unit scale) agree before rounding to 1e-5,
and after it to 1e-5 or one fp16 step where a value lies at a rounding boundary. 16-bit inputs: both paths multiply 16-bit values with fp32 accumulation,
but the torch path rounds the [N, D + r] product to the input dtype before the norm, so they
agree to about that resolution (fp16: 2e-3). The interpreter of Triton 3.7.1 gets bf16 dots
wrong, so the 16-bit case is fp16 here; bf16 on the GPU is checked by
`tools/reblock_device_check.py` (GPU vs CPU features). The sample moments kernel is checked
against a float64 product (fp32: exact inputs; fp16: inputs exact, fp32 sums). Rows of zeros (norm 0) and a non-finite row give finite features.
"""
import pytest
import torch

from triton_interpreter import kernel_imports

with kernel_imports():
    pytest.importorskip("triton")
    from adaptive_sparse_attention.kernels.triton import reblock_features

from adaptive_sparse_attention.backend import reblock_metric
from adaptive_sparse_attention.kernels.registry import resolve

pytestmark = pytest.mark.usefixtures("interpreter")


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")  # the inf row, on purpose
@pytest.mark.parametrize("dtype,D,N,tol", [(torch.float32, 32, 300, 1e-5), (torch.float16, 64, 517, 2e-3),
                                           (torch.float32, 24, 70, 1e-5)])
def test_fused_features_match_torch(monkeypatch, dtype, D, N, tol):
    g = torch.Generator().manual_seed(D + N)
    spread = torch.linspace(3.0, 0.3, D)  # distinct principal directions: a well-defined basis on both paths
    base, other = ((torch.randn(2, N + 9, D, generator=g) * spread).to(dtype) for _ in range(2))
    x, other = base[:, 4:N + 4], other[:, :N]  # strided heads, as a region's slice of Q/K is
    x[0, :5] = 0  # zero rows: norm 0, features 0
    x[1, 7, 3] = float("inf")  # a non-finite row must not reach the split
    want = reblock_metric.metric_features(x, other)
    got = reblock_metric.metric_features(x, other, resolve("triton", torch.device("cpu"), torch.float32, strict=True))
    assert got.dtype == want.dtype == torch.float16
    assert got.shape == want.shape == (2, N, reblock_metric.FEATURE_DIMS)
    assert torch.isfinite(got).all()
    lo, hi = torch.minimum(got, want), torch.maximum(got, want)
    adjacent = torch.nextafter(lo, hi) == hi  # one fp16 step apart: a value at a rounding boundary
    assert ((hi.float() - lo.float() <= tol) | adjacent).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("normalise", [False, True])
def test_gram_matches_torch(dtype, tol, normalise):
    """Plain and normalised moments against float64 (inputs exact in their dtype; the normalised
    rows are rounded to it as the kernel rounds them; fp16: a rounding flip moves an entry by
    about 1e-3 of its row's unit norm)."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(3, 403, 40, generator=g).to(dtype)[:, 1:400:2]  # strided heads and rows, 200 rows
    rows = a.double()
    factor = None
    if normalise:
        factor = (torch.randn(3, 40, 40, generator=g).tril() + 4 * torch.eye(40)).to(dtype)  # a lower factor
        s = rows @ factor.double()
        rows = (s / (s.norm(dim=-1, keepdim=True) + 1e-30)).to(dtype).double()
        rows[0, 3] = 0.0
        a[0, 3] = 0  # a zero row stays zero
    want = rows.transpose(-1, -2) @ rows / rows.shape[1]
    got = reblock_features.gram_triton(a, factor)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_gram_factor_is_checked():
    with pytest.raises(ValueError, match="factor must be"):
        reblock_features.gram_triton(torch.zeros(2, 8, 16), torch.zeros(2, 16, 8))


def test_bad_weights_are_named():
    x = torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match="r=8 is not allowed"):
        reblock_features.metric_project_triton(x, torch.zeros(1, 16, 16), torch.zeros(1, 16, 8))
    with pytest.raises(ValueError, match="factor must be a floating"):
        reblock_features.metric_project_triton(x, torch.zeros(1, 16, 8), torch.zeros(1, 16, 16))
