"""Install check run by ComfyUI-Manager after `requirements.txt`: reports, never installs.

It checks torch, Triton (``triton`` on Linux, ``triton-windows`` on Windows), comfy-kitchen, the
optional ``nvidia-cudnn-frontend`` and each GPU's architecture, and prints which attention kernel
will run where. It never installs, upgrades or replaces torch (or anything else): ComfyUI owns
its torch and comfy-kitchen pins, so this only tells what to install by hand when something is
missing. With a CUDA GPU it then prepares the machine (compiles the kernels, measures the dense
kernel: `python -m adaptive_sparse_attention prepare`), so the first sampler run does not wait
for that; ``ASA_SKIP_PREPARE=1`` skips it. Exit code 0 always: a missing optional piece makes
the pack slower, not broken.
"""
from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PACKAGE = "adaptive_sparse_attention"


def version(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def kernel_table():
    """The pack's `kernels/table.py`, imported from this folder under the package's name (ComfyUI
    runs this file from the pack's folder, whose name need not be the package's)."""
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACKAGE, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{PACKAGE}.kernels.table")


def gpu_lines(table, gpus: list[tuple[str, tuple[int, int]]], host) -> list[str]:
    """Per GPU (name, capability): which backend ``auto`` runs for every dtype, from the table itself."""
    lines = []
    for i, (name, cap) in enumerate(gpus):
        auto = table.auto_choices(table.Target("cuda", cap), host)
        lines.append(f"  cuda:{i} {name} (sm{cap[0]}{cap[1]}): auto runs "
                     + ", ".join(f"{str(d).removeprefix('torch.')} -> {b}" for d, b in auto.items()))
        if cap[0] in table.CUDNN_FAMILIES and not host.cudnn:
            lines.append(f"    this GPU can run cuDNN-frontend's block-sparse kernel for the exact keys, faster than "
                         f"the Triton kernel: {table.CUDNN_INSTALL}")
    return lines


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
    lines.append(f"  nvidia-cudnn-frontend {frontend}" if frontend else
                 "  nvidia-cudnn-frontend: not installed (optional; on Hopper GPUs `auto` runs its block-sparse kernel)")

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

    table = kernel_table()
    host = table.Host.current()
    if torch.cuda.is_available():
        gpus = [(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
                for i in range(torch.cuda.device_count())]
        lines += gpu_lines(table, gpus, host)
    else:
        auto = table.auto_choices(table.Target("cpu"), host)
        lines.append("  GPU: none visible -> every block that runs sparse uses the torch reference kernel on the "
                     f"CPU (for testing; real H3 runs need a CUDA GPU); auto runs {auto[torch.float32]}")
    lines.append("  what runs where (operation: backends [what each needs]):")
    return lines + ["    " + line for line in table.operation_lines()]


def prepare_ahead() -> None:
    """Compile the kernels and measure the dense kernel for the first GPU now (`bench/prepare.py`),
    so that the first sampler run does not wait for it. Skipped with ASA_SKIP_PREPARE=1; a failure
    is reported and leaves the install as it is (the node then prepares at its first use)."""
    import os

    import torch

    if os.environ.get("ASA_SKIP_PREPARE") == "1" or not torch.cuda.is_available():
        return
    kernel_table()  # imports the pack under its name
    prepare = importlib.import_module(f"{PACKAGE}.bench.prepare")
    try:
        prepare.run(prepare.parser().parse_args([]))
    except Exception as err:  # never fail the install: the node prepares on first use instead
        print(f"  preparation ahead failed ({type(err).__name__}: {err}); the node prepares the kernels at "
              "its first use instead (it says so before the wait)")


if __name__ == "__main__":
    print("\n".join(report()), file=sys.stdout)
    prepare_ahead()
