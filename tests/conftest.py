"""Shared fixtures."""
import pytest


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET=1 while a test runs (Triton kernels on CPU tensors)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
