"""Shared fixtures.

Without a GPU, Triton is first imported here under its interpreter (see triton_interpreter.py), so
the kernel tests pass in any order and selection, also after a module that imports the package's
nodes (and with them Triton) first; the interpreter patches Triton's language once per kernel
launch (`patch_language_once_per_launch`).
"""
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
