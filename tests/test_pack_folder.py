"""The README's ComfyUI commands work where the pack lives: a copy of the repository in
`<tmp>/ComfyUI/custom_nodes/<another name>`, run with a Python the pack is not installed into.

That Python is a fresh virtual environment (`venv --without-pip`, from the interpreter running the
tests) whose only addition is a `.pth` file listing the directory torch was imported from. Python
puts a `.pth` file's lines on `sys.path` but does not process the `.pth` files inside those
directories, so the test venv's own editable install (a `.pth` import hook in that same
site-packages) is not active there: torch, Triton and safetensors import, the pack does not. The
first test checks exactly that before the others rely on it. `install.py` without torch runs
under the system's `python3 -I` with no path added, which has no torch (skipped where it has).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

from adaptive_sparse_attention import SequenceLayout
from adaptive_sparse_attention.nodes.capture import save_capture
from adaptive_sparse_attention.version import __version__

REPO = Path(__file__).resolve().parents[1]
FOLDER = "ComfyUI-ASA-any-name"  # not the import name
README = (REPO / "README.md").read_text(encoding="utf-8")


def repository_files() -> list[str]:
    """The repository's files as a clone has them (tracked and new, not ignored), or every file
    outside caches and venvs where git is not available."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
        return [f for f in out.splitlines() if (REPO / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", ".pytest_cache"}
        return [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                if p.is_file() and not skip & set(p.relative_to(REPO).parts)]


@pytest.fixture(scope="module")
def comfyui(tmp_path_factory) -> Path:
    """A ComfyUI folder (the files install.py reads: main.py, comfyui_version.py, comfy/ldm/minimax)
    with the pack copied into custom_nodes under another name."""
    root = tmp_path_factory.mktemp("home") / "ComfyUI"
    (root / "comfy" / "ldm" / "minimax").mkdir(parents=True)
    (root / "main.py").write_text("")
    (root / "comfyui_version.py").write_text('__version__ = "0.33.0"\n')
    pack = root / "custom_nodes" / FOLDER
    for name in repository_files():
        (pack / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, pack / name)
    return root


@pytest.fixture(scope="module")
def packless_python(tmp_path_factory) -> str:
    """A Python with torch (and what sits beside it) but without the pack (module docstring)."""
    env = tmp_path_factory.mktemp("venv") / "py"
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(env)
    python = env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip()
    Path(site, "torch_only.pth").write_text(str(Path(torch.__file__).resolve().parents[1]) + "\n")
    return str(python)


def run(python: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([python, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


def test_the_test_python_has_torch_but_not_the_pack(packless_python, tmp_path):
    probe = "import importlib.util as u, torch; print(u.find_spec('adaptive_sparse_attention'))"
    result = run(packless_python, "-c", probe, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"


def test_readme_prepare_command_runs_from_the_pack_folder(comfyui, packless_python):
    assert "python install.py prepare" in README
    result = run(packless_python, "install.py", "prepare", cwd=comfyui / "custom_nodes" / FOLDER)
    assert result.returncode == 0, result.stdout + result.stderr
    if not torch.cuda.is_available():
        assert "no CUDA GPU visible: nothing to prepare" in result.stdout


def test_readme_evaluate_command_runs_on_a_capture(comfyui, packless_python, tmp_path):
    assert "python install.py evaluate" in README
    layout = SequenceLayout.from_segments([(0, 16, "text"), (16, 16 + 4 * 8 * 12, "video", (4, 8, 12))])
    g = torch.Generator().manual_seed(0)
    entries = [{"layer": 3, "step": 5, **{n: torch.randn(1, 1, layout.total, 64, generator=g) for n in "qkv"}}]
    path = tmp_path / "capture.safetensors"
    save_capture(str(path), entries, layout, {"model": "test"})
    result = run(packless_python, "install.py", "evaluate", str(path), "--ratios", "0.3",
                 cwd=comfyui / "custom_nodes" / FOLDER)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| L3s5 | dense |" in result.stdout
    assert "| L3s5 | ours:reblock:reweight:query | 0.300 |" in result.stdout


def test_install_check_reports_version_and_h3(comfyui, packless_python):
    result = run(packless_python, "install.py", cwd=comfyui / "custom_nodes" / FOLDER)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Adaptive Sparse Attention (MiniMax-H3) {__version__}" in result.stdout
    assert "ComfyUI 0.33.0" in result.stdout
    assert "has MiniMax-H3 (comfy/ldm/minimax)" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_install_check_says_when_comfyui_has_no_h3(tmp_path):
    root = tmp_path / "ComfyUI"
    (root / "comfy").mkdir(parents=True)
    (root / "comfyui_version.py").write_text('__version__ = "0.29.0"\n')
    pack = root / "custom_nodes" / FOLDER
    pack.mkdir(parents=True)
    for name in ("install.py", "version.py"):
        shutil.copy2(REPO / name, pack / name)
    result = run(sys.executable, "-c", "import install; print('\\n'.join(install.comfyui_lines()))", cwd=pack)
    assert result.returncode == 0, result.stderr
    assert "ComfyUI 0.29.0" in result.stdout
    assert "NO MiniMax-H3" in result.stdout
    assert "0.30.0 or later" in result.stdout


def system_python_without_torch() -> str | None:
    for name in ("python3", "python"):
        exe = shutil.which(name)
        if exe and os.path.realpath(exe) != os.path.realpath(sys.executable):
            probe = subprocess.run([exe, "-I", "-c", "import torch"], capture_output=True)
            if probe.returncode != 0:
                return exe
    return None


NO_TORCH = system_python_without_torch()
needs_python_without_torch = pytest.mark.skipif(NO_TORCH is None, reason="no Python without torch on this machine")


@needs_python_without_torch
def test_install_without_torch_names_the_python_to_use_and_exits_0(comfyui):
    result = run(NO_TORCH, "-I", "install.py", cwd=comfyui / "custom_nodes" / FOLDER)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert f"(MiniMax-H3) {__version__}" in result.stdout
    assert "has MiniMax-H3" in result.stdout
    assert "torch: NOT importable" in result.stdout
    assert r"python_embeded\python.exe" in result.stdout


@needs_python_without_torch
@pytest.mark.parametrize("command", [["prepare"], ["evaluate", "capture.safetensors"]])
def test_commands_without_torch_say_which_python(comfyui, command):
    result = run(NO_TORCH, "-I", "install.py", *command, cwd=comfyui / "custom_nodes" / FOLDER)
    assert result.returncode == 2
    assert "Traceback" not in result.stdout + result.stderr
    assert "torch is not importable" in result.stdout
    assert r"python_embeded\python.exe" in result.stdout


def test_install_check_survives_a_pack_that_does_not_import(tmp_path):
    """With torch present but the pack failing to import, the check says so and still exits 0."""
    pack = tmp_path / "custom_nodes" / FOLDER
    pack.mkdir(parents=True)
    for name in ("install.py", "version.py"):
        shutil.copy2(REPO / name, pack / name)
    (pack / "__init__.py").write_text("raise ImportError('a broken pack')\n")
    result = run(sys.executable, "install.py", cwd=pack)
    assert result.returncode == 0
    assert "Traceback" not in result.stdout + result.stderr
    assert "the pack could not be imported" in result.stdout
    assert "a broken pack" in result.stdout
    assert "torch " in result.stdout  # what it could read is still there


# --- the install step's preparation ahead (`install.prepare_ahead`), with stand-in children ------------------

def install_module():
    """install.py imported from this repository (it is a script, not a module of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("asa_install_script", REPO / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stand_in_gpu() -> tuple[str, str]:
    return "Stand-in GPU", ""


def child(code: str) -> list[str]:
    """A real child process running `code` in place of `install.py prepare`."""
    return [sys.executable, "-c", code]


def test_install_on_a_cpu_says_in_one_line_that_nothing_is_prepared(comfyui, packless_python):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: install.py prepares for it")
    result = run(packless_python, "install.py", cwd=comfyui / "custom_nodes" / FOLDER)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "preparation ahead" in line]
    assert lines == ["  preparation ahead: no CUDA GPU visible: nothing to compile (the CPU runs the torch "
                     "reference kernel)"]


def test_preparation_ahead_shows_the_child_progress_as_it_comes():
    install = install_module()
    lines = []
    code = "import time\nfor i in range(3):\n    print(f'kernel {i} compiled')\n    time.sleep(0.05)"
    assert install.prepare_ahead(stand_in_gpu, child(code), budget_s=60, echo=lines.append) is True
    assert "Stand-in GPU" in lines[0]
    assert lines[1:4] == [f"    kernel {i} compiled" for i in range(3)]
    assert lines[4].startswith("  preparation ahead: done in ")
    assert len(lines) == 5


def test_a_failing_preparation_is_one_line_with_its_error_and_the_install_goes_on():
    install = install_module()
    lines = []
    code = "print('started')\nraise RuntimeError('no kernel image for this GPU')"
    assert install.prepare_ahead(stand_in_gpu, child(code), budget_s=60, echo=lines.append) is False
    failed = [line for line in lines if "failed" in line]
    assert len(failed) == 1 and lines[-1] == failed[0]
    assert "exit code 1: RuntimeError: no kernel image for this GPU" in failed[0]
    assert not any("Traceback" in line for line in lines)  # the child's traceback is not echoed


def test_a_preparation_past_its_budget_is_stopped(monkeypatch):
    import time

    install = install_module()
    lines = []
    started = time.perf_counter()
    monkeypatch.setenv("ASA_PREPARE_BUDGET_S", "1")
    assert install.prepare_ahead(stand_in_gpu, child("import time; print('slow', flush=True); time.sleep(60)"),
                                 echo=lines.append) is False
    assert time.perf_counter() - started < 30
    assert "at most 1 s" in lines[0]
    assert lines[-1].startswith("  preparation ahead failed (stopped after 1 s (ASA_PREPARE_BUDGET_S")


@pytest.mark.parametrize("where", ["target", "command"])
def test_a_raising_preparation_is_one_line(where):
    install = install_module()
    lines = []

    def broken_target():
        raise RuntimeError("CUDA driver too old")

    target = broken_target if where == "target" else stand_in_gpu
    command = [str(REPO / "no-such-python")]
    assert install.prepare_ahead(target, command, budget_s=60, echo=lines.append) is False
    assert len([line for line in lines if "failed" in line]) == 1
    assert ("RuntimeError: CUDA driver too old" if where == "target" else "FileNotFoundError") in lines[-1]


def test_the_install_check_exits_0_when_the_preparation_raises(capsys):
    install = install_module()

    def prepare():
        raise MemoryError("out of host memory")

    assert install.main([], prepare=prepare) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "preparation" in line] == [
        "  preparation ahead failed (MemoryError: out of host memory); the node prepares the kernels at its first "
        "use instead"]


def test_skipping_the_preparation_is_said(monkeypatch):
    install = install_module()
    lines = []
    monkeypatch.setenv("ASA_SKIP_PREPARE", "1")
    assert install.prepare_ahead(stand_in_gpu, child("raise SystemExit(1)"), echo=lines.append) is False
    assert lines == ["  preparation ahead: skipped (ASA_SKIP_PREPARE=1); the node prepares the kernels at its "
                     "first use"]
