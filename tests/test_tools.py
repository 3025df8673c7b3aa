"""The developer tools in tools/: scripts that run from the repository root and keep their options,
and stay out of what a user installs (the wheel's package list and the ComfyUI registry archive)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"

# Each tool and the options its commands in BENCHMARKS.md and docs/ use.
OPTIONS = {
    "kernel_check.py": ["--out", "--quick", "--shapes", "--ratios", "--block-sizes", "--skip"],
    "reblock_device_check.py": ["--preset", "--scene", "--heads", "--out"],
    "kernel_split.py": ["--shapes", "--ratios", "--out"],
    "sparse_choice.py": ["--sizes", "--ratios", "--bounds", "--out"],
}


@pytest.mark.parametrize("script", OPTIONS)
def test_tool_help_lists_its_options(script):
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, f"tools/{script}", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"python tools/{script}" in done.stdout
    assert all(option in done.stdout for option in OPTIONS[script]), done.stdout


def test_tools_are_not_installed_with_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]
    assert not [p for p in packages if p.split(".")[-1] == "tools"], packages
    assert "tools" not in project["tool"]["comfy"].get("includes", [])
    ignored = [line.strip() for line in (ROOT / ".comfyignore").read_text().splitlines()]
    assert "tools/" in ignored


def test_tools_import_the_package_by_name_and_the_package_never_imports_them():
    for path in TOOLS.glob("*.py"):
        relative = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
        assert not relative, f"{path.name}: a script of tools/ imports the package by name, not relatively"
    for path in [*ROOT.glob("*.py"), *ROOT.glob("*/*.py")]:
        if path.parent.name in ("tools", "tests"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not any(n == "tools" or n.startswith("tools.") or n.endswith(".tools") for n in names), path
