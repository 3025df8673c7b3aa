"""FlashAttention-4 dense attention on sm90 and sm100, and why it cannot run elsewhere.

The package is never needed to install or test this pack: `unavailable_reason` says why it cannot
run, and the kernel is imported only when it is called. Its interface takes [B, S, H, D] (BSHD); a
transposed view of our [B, H, S, D] tensors is passed as is (the head dimension stays contiguous).
"""
from __future__ import annotations

import importlib.util

import torch

NAME = "FlashAttention-4"
ARCHS = (9, 10)  # sm major versions: sm90 (Hopper) and sm100 (Blackwell datacenter), the archs FA4 compiles for
DTYPES = (torch.bfloat16, torch.float16)


def installed() -> bool:
    """Whether `flash_attn.cute` can be found (importing its parent package must not fail)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError, AttributeError):
        return False


def unavailable_reason(q: torch.Tensor) -> str | None:
    """Why FlashAttention-4 cannot run dense attention on inputs like `q` here, or None.

    Args:
        q: a [B, H, S, D] query tensor (its device, dtype and head size decide).
    Returns:
        The reason, or None when it can run.
    """
    if not q.is_cuda:
        return "needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major not in ARCHS:
        return f"runs on sm90 and sm100 only, this GPU is sm{major}{minor}"
    if q.dtype not in DTYPES:
        return f"takes bfloat16 or float16, not {q.dtype}"
    if not installed():
        return "flash-attn-4 is not installed (pip install flash-attn-4)"
    return None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention (scale head_dim ** -0.5, no mask) on FlashAttention-4.

    Args:
        q, k, v: [B, H, S, D], one dtype (bfloat16 or float16) on an sm90 / sm100 GPU.
    Returns:
        [B, H, S, D] in q's dtype.
    """
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    if isinstance(out, tuple):  # (out, lse)
        out = out[0]
    return out.transpose(1, 2)
