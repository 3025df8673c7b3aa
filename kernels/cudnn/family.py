"""The `cudnn` family's rows: the attention on cuDNN-frontend's block-sparse kernel (its tail on Triton).

It implements the attention only; the planner's stages run on the next family by preference order.
"""
from __future__ import annotations

from ..vocabulary import Family, Host, Implementation, Requirement, SparseKernel, Target, dtype_in, head_dim_in
from .cudnn_attention import BLOCK_SIZE, DTYPES, HEAD_DIMS
from .cudnn_attention import ARCHS  # sm major versions it is enabled for
from .op import cudnn_attention

PACKAGE = "nvidia-cudnn-frontend"
INSTALL = "pip install nvidia-cudnn-frontend"  # brings nvidia-cutlass-dsl, its kernel compiler
MODULE = "cudnn.block_sparse_attention"


def _device(t: Target, host: Host) -> str | None:
    if t.device != "cuda":
        return f"the tensors are on {t.device}, and cuDNN runs on CUDA"
    if not host.has(MODULE):
        return f"{PACKAGE} (with its block-sparse attention) is not installed"
    if not host.has("triton"):
        return "Triton is not installed (it adds the tail)"
    if t.capability is not None and t.capability[0] not in ARCHS:
        return (f"sm{t.capability[0]}{t.capability[1]} is not enabled for it (enabled: "
                + ", ".join(f"sm{a}x" for a in ARCHS) + ")")
    return None


REQUIRES = (
    Requirement("CUDA " + ", ".join(f"sm{a}x" for a in ARCHS) + f", {PACKAGE} and Triton installed", _device,
                (MODULE, "triton")),
    dtype_in(DTYPES), head_dim_in(HEAD_DIMS),
    Requirement(f"block_size {BLOCK_SIZE}", lambda t, h: None if t.block_size in (None, BLOCK_SIZE) else
                f"block_size {t.block_size} is not supported (expected {BLOCK_SIZE})"),
    Requirement("precision bf16", lambda t, h: None if t.precision == "bf16" else
                f"precision {t.precision!r} is not supported (its 8-bit path returns no log-sum-exp to merge the tail "
                "with; the Triton kernel has the 8-bit loop)"))

ATTENTION = Implementation("attention", "cudnn", cudnn_attention, REQUIRES,
                           borrows=(("triton", "tiled_pack"), ("triton", "add_tail")))  # handed in
CUDNN_BF16 = SparseKernel("cudnn", "cuDNN-frontend", ATTENTION)  # a candidate of the measured sparse choice
CUDNN = Family("cudnn", (ATTENTION,), auto="cuda", compiles=True)
