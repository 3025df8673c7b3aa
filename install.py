"""Install check run by ComfyUI-Manager after `requirements.txt`: reports, never installs.

It checks torch, Triton (``triton`` on Linux, ``triton-windows`` on Windows), comfy-kitchen, the
optional ``nvidia-cudnn-frontend`` and each GPU's architecture, and prints which attention kernel
will run where. It never installs, upgrades or replaces torch (or anything else): ComfyUI owns
its torch and comfy-kitchen pins, so this only tells what to install by hand when something is
missing. Exit code 0 always: a missing
optional piece makes the pack slower, not broken.
"""
from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
MIN_CAPABILITY = (8, 0)  # the Triton kernel's bf16 tensor-core path needs Ampere or newer
CUDNN_FAMILIES = (9,)  # kernels/cudnn_attention.py FAMILIES (the pack is not importable by name here)


def version(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def kernel_families():
    """`family_of` from kernels/configs.py, loaded by path (the pack is not importable by name here)."""
    spec = importlib.util.spec_from_file_location("_asa_kernel_configs", ROOT / "kernels" / "configs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.family_of


def report() -> list[str]:
    """The report's lines: torch, Triton, comfy-kitchen and, per GPU, which attention kernel runs there."""
    lines = [f"Adaptive Sparse Attention (MiniMax-H3): install check on {platform.system()} / Python "
             f"{platform.python_version()}"]
    try:
        import torch
    except ImportError:
        return lines + ["  torch: NOT importable. Install ComfyUI's own torch first; this pack never installs torch."]
    lines.append(f"  torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}): left as it is")

    windows = platform.system() == "Windows"
    triton_dist = "triton-windows" if windows else "triton"
    triton_version = version(triton_dist) or version("triton")
    if triton_version is None:
        hint = ("pip install triton-windows, in the version its README lists for your torch" if windows
                else "it normally comes with torch's CUDA wheels; otherwise pip install the triton version your torch pins")
        lines.append(f"  {triton_dist}: not installed -> sparse attention uses the torch reference kernel "
                     f"(correct, much slower). To get the fast kernel: {hint}")
    else:
        lines.append(f"  {triton_dist} {triton_version}: fast Triton kernel available on supported GPUs")

    frontend = version("nvidia-cudnn-frontend")
    if frontend is None:
        lines.append("  nvidia-cudnn-frontend: not installed (optional; the engine's backend='cudnn' on sm90 uses its "
                     "block-sparse kernel for the exact keys, the node runs Triton)")
    else:
        lines.append(f"  nvidia-cudnn-frontend {frontend}: the engine's backend='cudnn' can use it on sm90 "
                     "(asked for by name; the node and backend='auto' run Triton)")

    kitchen = version("comfy-kitchen")
    if kitchen is None:
        lines.append("  comfy-kitchen: not installed -> Q/K norm + RoPE use the equivalent torch code")
    else:
        try:
            import comfy_kitchen
            has_sol = hasattr(comfy_kitchen, "sol_attn")
        except Exception as err:  # it imports `packaging` without declaring it
            lines.append(f"  comfy-kitchen {kitchen}: installed but not importable ({err}); torch code is used")
        else:
            lines.append(f"  comfy-kitchen {kitchen}: fused RMSNorm+RoPE used for Q/K production"
                         + ("; sol_attn present (benchmark baseline)" if has_sol else ""))

    if not torch.cuda.is_available():
        return lines + ["  GPU: none visible -> every block that runs sparse uses the torch reference kernel on the "
                        "CPU (for testing; real H3 runs need a CUDA GPU)"]
    family_of = kernel_families()
    for i in range(torch.cuda.device_count()):
        cap = torch.cuda.get_device_capability(i)
        name = torch.cuda.get_device_name(i)
        if cap < MIN_CAPABILITY:
            where = "torch reference kernel (the Triton kernel needs compute capability 8.0+)"
        elif triton_version is None:
            where = "torch reference kernel (install Triton for the fast kernel)"
        else:
            where = f"Triton kernel, {family_of(cap)} configs"
            if frontend is not None and cap[0] in CUDNN_FAMILIES:
                where += "; backend='cudnn' also runs here"
        lines.append(f"  cuda:{i} {name} (sm{cap[0]}{cap[1]}): {where}")
    return lines


if __name__ == "__main__":
    print("\n".join(report()), file=sys.stdout)
