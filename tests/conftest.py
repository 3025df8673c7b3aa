"""Shared fixtures.

Without a GPU, Triton is first imported here under its interpreter (see triton_interpreter.py), so
the kernel tests pass in any order and selection, also after a module that imports the package's
nodes (and with them Triton) first; the interpreter patches Triton's language once per kernel
launch (`patch_language_once_per_launch`).

Markers (pytest.ini): a test that uses the `interpreter` fixture is marked `interpreter` here; a
test marked `comfyui` (`comfyui_harness.needs_comfyui`) is skipped unless COMFYUI_PATH holds a
ComfyUI checkout.
"""
import os

import pytest
import torch

from triton_interpreter import interpreter_env, patch_language_once_per_launch

if not torch.cuda.is_available():
    with interpreter_env():
        try:
            import triton  # noqa: F401
        except ImportError:  # the no-Triton paths are tested then
            pass
        else:
            patch_language_once_per_launch()


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET=1 while a test runs (Triton kernels on CPU tensors).

    Where CUDA is available Triton was imported compiled, so its kernels cannot take CPU tensors:
    these tests are skipped there, and tests/test_gpu_kernels.py checks the compiled kernels."""
    if torch.cuda.is_available():
        pytest.skip("Triton interpreter tests run on machines without CUDA (as CI); test_gpu_kernels.py "
                    "checks the compiled kernels here")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_comfyui = os.path.isfile(os.path.join(os.environ.get("COMFYUI_PATH", ""), "main.py"))
    for item in items:
        if "interpreter" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.interpreter)
        if item.get_closest_marker("comfyui") is not None and not has_comfyui:
            item.add_marker(pytest.mark.skip(reason="set COMFYUI_PATH to a ComfyUI checkout to run these tests"))
