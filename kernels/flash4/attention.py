"""FlashAttention-4 dense attention on sm90 and sm100, and why it cannot run elsewhere.

The package is never needed to install or test this pack: `unavailable_reason` says why it cannot
run, and the kernel is imported only when it is called. Its interface takes [B, S, H, D] (BSHD); a
transposed view of our [B, H, S, D] tensors is passed as is (the head dimension stays contiguous).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

NAME = "FlashAttention-4"
CACHE_ENABLED = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"  # "1": compiled kernels kept on disk (read at import)
CACHE_DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"  # where (read at import)
CACHE_FOLDER = "flash_attention_cute_dsl_cache"  # its folder under the pack's own
ARCHS = (9, 10)  # sm major versions: sm90 (Hopper) and sm100 (Blackwell datacenter), the archs FA4 compiles for
DTYPES = (torch.bfloat16, torch.float16)


def installed() -> bool:
    """Whether `flash_attn.cute` can be found (importing its parent package must not fail)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError, AttributeError):
        return False


def has_disk_cache() -> bool:
    """Whether the installed FlashAttention-4 has its disk cache of compiled kernels (``flash_attn/cute/
    cache_utils.py``), found from the package's folder without importing it."""
    try:
        spec = importlib.util.find_spec("flash_attn.cute")
    except (ImportError, ValueError, AttributeError):
        return False
    folders = [] if spec is None else (spec.submodule_search_locations or [])
    return any((Path(folder) / "cache_utils.py").is_file() for folder in folders)


def disk_cache(folder: Path) -> str:
    """Point FlashAttention-4's disk cache of compiled kernels at `folder`/CACHE_FOLDER, so a process after
    the one that compiled them (`prepare`) loads them instead of compiling its CuTe DSL kernel again.

    FlashAttention-4 reads CACHE_ENABLED and CACHE_DIR once, when ``flash_attn.cute.cache_utils`` is imported
    (with ``flash_attn.cute``): they are set here only before that import, and only where the user set neither (theirs are left as they are).

    Args:
        folder: a folder the pack owns (where its choice files are).
    Returns:
        The line that says where FlashAttention-4 keeps its kernels, or why its first call compiles.
    """
    target = folder / CACHE_FOLDER
    ours = f"{NAME} keeps its compiled kernels in {target} (its first call loads them from there)"
    if os.environ.get(CACHE_ENABLED) == "1" and os.environ.get(CACHE_DIR) == str(target):
        return ours
    if CACHE_ENABLED in os.environ or CACHE_DIR in os.environ:
        return (f"{NAME} keeps its compiled kernels as the environment says ({CACHE_ENABLED}="
                f"{os.environ.get(CACHE_ENABLED, '')!r}, {CACHE_DIR}={os.environ.get(CACHE_DIR, '')!r})")
    if not has_disk_cache():
        return (f"{NAME} here has no disk cache of compiled kernels (flash_attn/cute/cache_utils.py): its first "
                "call compiles in every process")
    if "flash_attn.cute.cache_utils" in sys.modules:
        return (f"{NAME} was imported before this pack could point its disk cache at {target}: its "
                f"first call compiles in this process unless {CACHE_ENABLED}=1 is set before ComfyUI starts")
    os.environ[CACHE_ENABLED] = "1"
    os.environ[CACHE_DIR] = str(target)
    return ours


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
