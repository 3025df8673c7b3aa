"""Install check, and the pack's commands for a pack folder that is not installed as a package.

`python install.py` (ComfyUI-Manager runs it after `requirements.txt`) reports, never installs:
the pack's version, whether this ComfyUI has MiniMax-H3, torch, Triton (``triton`` on Linux,
``triton-windows`` on Windows), comfy-kitchen, the optional ``nvidia-cudnn-frontend`` and which
attention kernel runs on each GPU. It never installs, upgrades or replaces torch (or anything
else): ComfyUI owns its torch and comfy-kitchen pins, so this only tells what to install by hand.
With a CUDA GPU it then prepares the machine (compiles the kernels, measures the dense kernel),
so the first sampler run does not wait for that; ``ASA_SKIP_PREPARE=1`` skips it. Its exit code
is 0 always, also without torch (it then says which Python to run it with): a missing optional
piece makes the pack slower, not broken.

`python install.py prepare [options]` and `python install.py evaluate FILE [options]` run the
package's `prepare` and `evaluate` commands from this folder, whatever its name under
``custom_nodes``: the folder is imported under the package's name, so ComfyUI's Python runs
them without the pack being installed into it (`python install.py COMMAND --help` lists the
options). Their exit code is the command's own; 2 when this Python has no torch.
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
COMMANDS = ("prepare", "evaluate")
H3_FIRST_RELEASE = "0.30.0"  # the first ComfyUI release with comfy/ldm/minimax
WHICH_PYTHON = ("Run it with the Python that runs ComfyUI: in the Windows portable build "
                r"`python_embeded\python.exe ComfyUI\custom_nodes\<this folder>\install.py` from the "
                "ComfyUI_windows_portable folder; in a venv or conda install, that environment's `python` "
                "(activate it first). This pack never installs torch.")


def version_in(path: Path) -> str | None:
    """The `__version__ = "..."` value of a Python file, read as text (nothing is imported)."""
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("\"'")
    return None


def pack_version() -> str:
    """The pack's version (`version.py`)."""
    return version_in(ROOT / "version.py") or "unknown"


def comfyui_lines(pack_dir: Path = ROOT) -> list[str]:
    """Whether the ComfyUI this folder sits in (``<ComfyUI>/custom_nodes/<folder>``) has MiniMax-H3,
    read from its files (comfy/ldm/minimax, comfyui_version.py) without importing it."""
    root = pack_dir.parent.parent
    if pack_dir.parent.name != "custom_nodes" or not (root / "comfy").is_dir():
        return ["  ComfyUI: this folder is not in a ComfyUI `custom_nodes` folder, so whether ComfyUI has "
                "MiniMax-H3 is not checked"]
    found = version_in(root / "comfyui_version.py") or "(unknown version)"
    if (root / "comfy" / "ldm" / "minimax").is_dir():
        return [f"  ComfyUI {found} at {root}: has MiniMax-H3 (comfy/ldm/minimax)"]
    return [f"  ComfyUI {found} at {root}: NO MiniMax-H3 (comfy/ldm/minimax is missing); update ComfyUI to "
            f"{H3_FIRST_RELEASE} or later, the first release with MiniMax-H3"]


def version(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def pack_module(name: str):
    """The pack's module `name` (e.g. ``kernels.registry``), imported from this folder under the
    package's name: ComfyUI runs this file from the pack's folder, whose name need not be the
    package's, with a Python the pack is not installed into."""
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACKAGE, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[PACKAGE]
            raise
    return importlib.import_module(f"{PACKAGE}.{name}")


def kernel_table():
    """The pack's `kernels/registry.py` (what runs where)."""
    return pack_module("kernels.registry")


def gpu_lines(table, gpus: list[tuple[str, tuple[int, int]]], host) -> list[str]:
    """Per GPU (name, capability): which kernel family ``auto`` runs for every dtype, from the table itself."""
    cudnn = importlib.import_module(f"{PACKAGE}.kernels.cudnn.family")
    lines = []
    for i, (name, cap) in enumerate(gpus):
        auto = table.auto_choices(table.Target("cuda", cap), host)
        lines.append(f"  cuda:{i} {name} (sm{cap[0]}{cap[1]}): auto runs "
                     + ", ".join(f"{str(d).removeprefix('torch.')} -> {b}" for d, b in auto.items()))
        if cap[0] in cudnn.GPU_FAMILIES and not host.has(cudnn.MODULE):
            lines.append(f"    this GPU can run cuDNN-frontend's block-sparse kernel for the exact keys, faster than "
                         f"the Triton kernel: {cudnn.INSTALL}")
    return lines


def report() -> list[str]:
    """The report's lines: torch, Triton, comfy-kitchen and, per GPU, which attention kernel runs there."""
    lines = [f"Adaptive Sparse Attention (MiniMax-H3) {pack_version()}: install check on {platform.system()} / "
             f"Python {platform.python_version()} ({sys.executable})"] + comfyui_lines()
    if not has_torch():
        return lines + [f"  torch: NOT importable in this Python, so nothing more is checked. {WHICH_PYTHON}"]
    import torch

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

    try:
        return lines + kernel_lines(torch)
    except Exception as err:  # the report says what it could not read instead of failing the install
        return lines + [f"  the pack could not be imported from {ROOT} ({type(err).__name__}: {err}); ComfyUI's "
                        "console shows the same error when it loads the pack"]


def kernel_lines(torch) -> list[str]:
    """Per GPU (or the CPU) which backend `auto` runs, and the table of what runs where."""
    table = kernel_table()
    host = table.current_host()
    lines = []
    if torch.cuda.is_available():
        gpus = [(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
                for i in range(torch.cuda.device_count())]
        lines += gpu_lines(table, gpus, host)
    else:
        auto = table.auto_choices(table.Target("cpu"), host)
        lines.append("  GPU: none visible -> every block that runs sparse uses the torch reference kernel on the "
                     f"CPU (for testing; real H3 runs need a CUDA GPU); auto runs {auto[torch.float32]}")
    lines.append("  what runs where (operation: kernel families [what each needs]):")
    return lines + ["    " + line for line in table.operation_lines()]


def prepare_ahead() -> None:
    """Compile the kernels and measure the dense kernel for the first GPU now (`bench/prepare.py`),
    so that the first sampler run does not wait for it. Skipped with ASA_SKIP_PREPARE=1; a failure
    is reported and leaves the install as it is (the node then prepares at its first use)."""
    import os

    if os.environ.get("ASA_SKIP_PREPARE") == "1" or not has_torch():
        return
    import torch

    if not torch.cuda.is_available():
        return
    try:
        prepare = pack_module("bench.prepare")
        prepare.run(prepare.parser().parse_args([]))
    except Exception as err:  # never fail the install: the node prepares on first use instead
        print(f"  preparation ahead failed ({type(err).__name__}: {err}); the node prepares the kernels at "
              "its first use instead (it says so before the wait)")


def has_torch() -> bool:
    """Whether this Python can import torch (found without importing it)."""
    return importlib.util.find_spec("torch") is not None


def run_command(argv: list[str]) -> int:
    """`prepare` or `evaluate` (argv[0]) with the rest of argv as its options, run by the package's
    own command line from this folder. Returns its exit code; 2 when this Python has no torch."""
    if not has_torch():
        print(f"install.py {argv[0]}: torch is not importable in this Python ({sys.executable}). {WHICH_PYTHON}")
        return 2
    cli = pack_module("bench.cli")
    return cli.main(argv)


def main(argv: list[str]) -> int:
    """No arguments: the install check (exit code 0 always). `prepare ...` / `evaluate FILE ...`:
    the package's commands (their exit code)."""
    if argv and argv[0] in COMMANDS:
        return run_command(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv:
        print(f"install.py: {' '.join(argv)!r} is not a command; allowed: no argument (the install check), "
              f"{' or '.join(COMMANDS)} (`python install.py prepare --help`)")
        return 2
    try:
        print("\n".join(report()), flush=True)
        prepare_ahead()
    except Exception as err:  # the check must never fail an install: the pack still loads
        print(f"  install check stopped early ({type(err).__name__}: {err}); the pack itself is not affected")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
