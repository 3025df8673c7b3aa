"""Triton's interpreter for the kernel tests (CPU tensors, no GPU).

Triton decorates its language functions when it is first imported, so TRITON_INTERPRET=1 must
be set before that; it is put back afterwards because other test modules check the no-GPU
paths. Kernel test modules also use the `interpreter` fixture (conftest.py), which sets it
around each test (the launchers and the dispatcher read it at call time).
"""
import os
from contextlib import contextmanager
from typing import Iterator



@contextmanager
def interpreter_env() -> Iterator[None]:
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved

