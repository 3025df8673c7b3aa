"""The warning of a run whose sparse blocks run the pure-torch reference kernel (CPU, or a GPU without
Triton): correct, but slower than dense attention, so the user is told why and what to install."""
from __future__ import annotations

import platform

import torch

from ..backend.config import SparseConfig
from ..kernels.registry import unavailable_reason


def reference_kernel_notice(family: str, config: SparseConfig, device: torch.device, dtype: torch.dtype,
                            head_dim: int) -> str | None:
    """What to tell the user when the sparse blocks of a call run the torch reference kernel.

    Args:
        family: the kernel family the call's sparse attention resolved to (`Kernels.family`).
        config: the run's config (a kernel asked for by name, ``kernel="torch"``, is not warned about).
        device, dtype, head_dim: of the call's Q/K/V.
    Returns:
        One line with the reason and what to install, or None when a fast kernel runs.
    """
    if family != "torch" or config.kernel == "torch":
        return None
    if device.type != "cuda":
        reason = f"the model runs on the {device.type.upper()}"
        fix = ("the fast kernels need an NVIDIA GPU (sm80 or newer) with Triton; bypass this node on the CPU "
               "except for tests")
    else:
        reason = unavailable_reason("triton", device, dtype, head_dim, config.block_size) or "Triton cannot run here"
        package = "triton-windows" if platform.system() == "Windows" else "triton"
        fix = (f"install {package} into ComfyUI's Python in the version your torch pins (`python install.py` in the "
               "pack's folder says what is missing), or bypass this node until then" if "not installed" in reason
               else "bypass this node on this GPU (dense attention is faster here)")
    return (f"sparse blocks run the pure-torch reference kernel, which is correct but slower than dense attention: "
            f"{reason}; {fix}")
