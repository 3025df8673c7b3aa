"""The `sm90` family's rows: the attention on the warp-specialised Hopper kernel (its tail on Triton).

It implements the attention only; the planner's stages run on the next family by preference order. The
kernel is Gluon (shipped in the Triton wheel torch brings), whose API moves between Triton releases: it is
offered on the releases it was built and tested with.
"""
from __future__ import annotations

import torch

from ..vocabulary import Family, Host, Implementation, Requirement, SparseKernel, Target, dtype_in, head_dim_in
from .op import sm90_attention

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)
BLOCK_SIZE = 64
CAPABILITY = (9, 0)  # wgmma and the TMA copy engine as sm90a has them; sm100 and sm120 have neither in this form
TRITONS = ("3.6", "3.7")  # Triton releases whose Gluon Hopper API (shipped in the wheel) the kernel is written for


def _device(t: Target, host: Host) -> str | None:
    if t.device != "cuda":
        return f"the tensors are on {t.device}, and the sm90 kernel runs on a Hopper GPU"
    if t.capability is not None and tuple(t.capability) != CAPABILITY:
        return f"sm{t.capability[0]}{t.capability[1]} is not Hopper (the kernel needs sm90's wgmma and TMA)"
    if not host.has("triton"):
        return "Triton is not installed"
    if host.interpret:
        return "Triton runs under its CPU interpreter (TRITON_INTERPRET=1), which has no Gluon"
    release = host.release("triton")
    if release not in TRITONS:
        return (f"Triton {release or '(release unknown)'}: the kernel's Gluon code is written for Triton "
                f"{' or '.join(TRITONS)}")
    return None


REQUIRES = (
    Requirement(f"CUDA sm90, Triton {' or '.join(TRITONS)} (its Gluon)", _device, ("triton",)),
    dtype_in(DTYPES), head_dim_in(HEAD_DIMS),
    Requirement(f"block_size {BLOCK_SIZE}", lambda t, h: None if t.block_size in (None, BLOCK_SIZE) else
                f"block_size {t.block_size} is not supported (expected {BLOCK_SIZE})"),
    Requirement("precision bf16", lambda t, h: None if t.precision == "bf16" else
                f"precision {t.precision!r} is not supported (the Triton kernel has the 8-bit loop)"))

ATTENTION = Implementation("attention", "sm90", sm90_attention, REQUIRES,
                           borrows=(("triton", "tiled_pack"), ("triton", "add_tail")))  # handed in
SM90_BF16 = SparseKernel("sm90", "Hopper warp-specialised (Gluon)", ATTENTION)  # a candidate of the sparse choice
SM90 = Family("sm90", (ATTENTION,), auto="cuda", compiles=True)
