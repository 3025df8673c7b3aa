"""Why the sparse blocks of a call run dense where no fast sparse kernel runs: the pure-torch reference (what
``auto`` resolves to on the CPU or a GPU without Triton) is correct but slower than dense attention, so the
node runs it only when it is asked for by name (``kernel="torch"``; a family named that cannot run falls back
as the registry says, `kernels/registry.py`)."""
from __future__ import annotations

import platform

import torch

from ..backend.config import SparseConfig
from ..kernels.registry import current_host, resolve_family, unavailable_reason
from ..kernels.sparse_choice import choice as sparse_choice
from ..kernels.vocabulary import Target

REASON = "no fast sparse kernel runs on this device"  # the report's count of the blocks it sends to dense


def no_fast_kernel(config: SparseConfig, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why a sparse call of `config` under ``kernel="auto"`` would run the torch reference (the node then runs
    it dense), or None: its family is the reference and fewer than two sparse-choice candidates run here.

    Args:
        config: the engine config of the sparse calls (a kernel named is run as the registry resolves it).
        device, dtype, head_dim: of the call's Q/K/V.
    Returns:
        The reason and what to install (`dense_notice` and `strict_refusal` say it to the user); None where
        a fast kernel runs or a kernel was named.
    """
    if config.kernel != "auto" or resolve_family("auto", device, dtype, head_dim=head_dim,
                                                 block_size=config.block_size) != "torch":
        return None
    target, host = Target.of(device, dtype, head_dim, config.block_size), current_host()
    rows = [row for row in sparse_choice.SPARSE_KERNELS if (row.precision == "bf16" or config.exact_precision == "8-bit")
            and row.unavailable(target, host) is None]
    if len(rows) >= 2:  # auto's attention is then the measured sparse choice among them (`SparseChoices`)
        return None
    if device.type != "cuda":
        reason = f"the model runs on the {device.type.upper()}"
        fix = "the fast kernels need an NVIDIA GPU (sm80 or newer) with Triton"
    else:
        reason = unavailable_reason("triton", device, dtype, head_dim, config.block_size) or "Triton cannot run here"
        package = "triton-windows" if platform.system() == "Windows" else "triton"
        fix = (f"install {package} into ComfyUI's Python in the version your torch pins (`python install.py` in the "
               "pack's folder says what is missing)" if "not installed" in reason else "dense attention is faster here")
    return f"{REASON} ({reason}); {fix}"


def dense_notice(why: str) -> str:
    """What the run says once (and its report keeps) when its sparse blocks run dense for `why`."""
    return (f"sparse blocks run dense attention on the fastest dense kernel: {why}. kernel='torch' runs them "
            f"sparse on the pure-torch reference (correct, but slower than dense attention)")


def strict_refusal(title: str, why: str) -> str:
    """The error of a strict run whose sparse blocks would run dense for `why`."""
    return (f"{title}: {why}; strict=True refuses to run the sparse blocks dense (kernel='torch' runs them on the "
            "pure-torch reference)")
