"""Install check, and the pack's commands for a pack folder that is not installed as a package.

`python install.py` (ComfyUI-Manager runs it after `requirements.txt`) reports, never installs:
the pack's version, whether this ComfyUI has MiniMax-H3, torch, Triton (``triton`` on Linux,
``triton-windows`` on Windows), comfy-kitchen, the optional ``nvidia-cudnn-frontend`` and which
attention kernel runs on each GPU. It never installs, upgrades or replaces torch (or anything
else): ComfyUI owns its torch and comfy-kitchen pins, so this only tells what to install by hand.
With a CUDA GPU and Triton it then prepares the machine (compiles the kernels, measures the dense
kernel: ``install.py prepare`` in a child process, its progress shown, stopped after
``ASA_PREPARE_BUDGET_S`` seconds, 900 by default), so the first sampler run does not wait for that;
``ASA_SKIP_PREPARE=1`` skips it; on a CPU-only machine one line says there is nothing to prepare,
and a failure is one line too. Its exit code is 0 always, also without torch (it then says which Python to run it with): a missing optional
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
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent
PACKAGE = "adaptive_sparse_attention"
COMMANDS = ("prepare", "evaluate")
SKIP_ENV = "ASA_SKIP_PREPARE"
BUDGET_ENV = "ASA_PREPARE_BUDGET_S"
PREPARE_BUDGET_S = 900.0  # the install step's preparation is stopped after this (about a minute is usual)
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
        if cap[0] in cudnn.ARCHS and not host.has(cudnn.MODULE):
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


def say(line: str) -> None:
    """Print one line now (ComfyUI-Manager shows the install step's output as it comes)."""
    print(line, flush=True)


def prepare_target() -> tuple[str | None, str]:
    """(the GPU to prepare the kernels for, "") or (None, why nothing is prepared, one line): only with
    a CUDA GPU and Triton (the torch reference kernel, all a CPU runs, compiles nothing)."""
    if not has_torch():
        return None, "torch is not importable in this Python"
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA GPU visible: nothing to compile (the CPU runs the torch reference kernel)"
    if importlib.util.find_spec("triton") is None:
        return None, "Triton is not installed: nothing to compile (the torch reference kernel runs)"
    return torch.cuda.get_device_name(0), ""


def prepare_budget() -> float:
    """Seconds the install step's preparation may take (``ASA_PREPARE_BUDGET_S``, default PREPARE_BUDGET_S)."""
    raw = os.environ.get(BUDGET_ENV, "")
    try:
        budget = float(raw) if raw else PREPARE_BUDGET_S
    except ValueError:
        budget = -1.0
    if not budget > 0:
        print(f"  {BUDGET_ENV}={raw!r} is not allowed (a number of seconds above 0): {PREPARE_BUDGET_S:.0f} s is used")
        return PREPARE_BUDGET_S
    return budget


def run_bounded(command: list[str], budget_s: float, echo: Callable[[str], None]) -> str | None:
    """Run `command`, echoing its standard output line by line (its progress), for at most `budget_s`.

    Returns:
        None when it exits with 0, else one line saying what went wrong (its exit code and the last
        line of its standard error, or that it ran past the budget and was stopped).
    """
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as errors:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, encoding="utf-8",
                                 errors="replace", cwd=str(ROOT), env=dict(os.environ, PYTHONUNBUFFERED="1"))

        def relay() -> None:
            for line in child.stdout:
                echo("    " + line.rstrip())

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        try:
            code = child.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return f"stopped after {budget_s:.0f} s ({BUDGET_ENV} sets the limit)"
        finally:
            reader.join(timeout=5)
            child.stdout.close()
        if code == 0:
            return None
        errors.seek(0)
        last = next((line.strip() for line in reversed(errors.read().splitlines()) if line.strip()), "no message")
        return f"exit code {code}: {last}"


def prepare_ahead(target: Callable[[], tuple[str | None, str]] = prepare_target, command: list[str] | None = None,
                  budget_s: float | None = None, echo: Callable[[str], None] | None = None) -> bool:
    """Compile the kernels and measure the dense kernel for the GPU `target` finds (the package's
    `prepare` command, run in a child process of this Python), so that the first sampler run does
    not wait for it. Its progress is echoed; whatever happens, one line says how it ended and the
    install goes on (the node then prepares at its first use).

    Args:
        target: the GPU to prepare for, or None and why not (`prepare_target`).
        command: the child's command line; None: ``python install.py prepare`` from this folder.
        budget_s: seconds after which the child is stopped; None: `prepare_budget()`.
        echo: prints one line.
    Returns:
        Whether the kernels were prepared.
    """
    echo = echo or say
    if os.environ.get(SKIP_ENV) == "1":
        echo(f"  preparation ahead: skipped ({SKIP_ENV}=1); the node prepares the kernels at its first use")
        return False
    try:
        gpu, why = target()
        if gpu is None:
            echo(f"  preparation ahead: {why}")
            return False
        budget = prepare_budget() if budget_s is None else budget_s
        echo(f"  preparation ahead for {gpu}: compiling the kernels and measuring the dense kernel "
             f"(at most {budget:.0f} s; {SKIP_ENV}=1 skips it)")
        start = time.perf_counter()
        problem = run_bounded(command or [sys.executable, str(ROOT / "install.py"), "prepare"], budget, echo)
    except Exception as err:  # never fail the install: the node prepares on first use instead
        problem = f"{type(err).__name__}: {err}"
    if problem is None:
        echo(f"  preparation ahead: done in {time.perf_counter() - start:.0f} s")
        return True
    echo(f"  preparation ahead failed ({problem}); the node prepares the kernels at its first use instead "
         "(it says so before the wait)")
    return False


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


def main(argv: list[str], prepare: Callable[[], object] = prepare_ahead) -> int:
    """No arguments: the install check, then `prepare` (`prepare_ahead`; exit code 0 always).
    `prepare ...` / `evaluate FILE ...`: the package's commands (their exit code)."""
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
    except Exception as err:  # the check must never fail an install: the pack still loads
        print(f"  install check stopped early ({type(err).__name__}: {err}); the pack itself is not affected")
    try:
        prepare()
    except Exception as err:  # nor the preparation
        print(f"  preparation ahead failed ({type(err).__name__}: {err}); the node prepares the kernels at its "
              "first use instead")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
