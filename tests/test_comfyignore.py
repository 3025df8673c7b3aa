"""The registry package (.comfyignore) leaves the tests out and keeps everything the pack runs."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDED = ("__init__.py", "__main__.py", "install.py", "requirements.txt", "pyproject.toml", "LICENSE", "README.md",
          "backend/", "bench/", "kernels/", "nodes/", "workflows/", "docs/performance-notes.md")


def patterns() -> list[str]:
    lines = (ROOT / ".comfyignore").read_text(encoding="utf-8").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def test_tests_and_ci_are_left_out():
    assert {"tests/", ".ci/"} <= set(patterns())


def test_nothing_the_pack_runs_is_left_out():
    for pattern in patterns():
        bare = pattern.strip("/")
        hit = [p for p in NEEDED if p.strip("/") == bare or p.startswith(bare + "/") or bare.startswith("*")
               and p.endswith(bare[1:])]
        assert not hit, f".comfyignore pattern {pattern!r} leaves out {hit}"
