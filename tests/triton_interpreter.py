"""Triton's interpreter for the kernel tests (CPU tensors, no GPU).

Triton decorates its language functions when it is first imported, so TRITON_INTERPRET=1 must
be set before that; it is put back afterwards because other test modules check the no-GPU
paths. Kernel test modules also use the `interpreter` fixture (conftest.py), which sets it
around each test (the launchers and the dispatcher read it at call time).

`patch_language_once_per_launch` makes the interpreter cheaper without changing what it runs.
"""
import inspect
import os
from contextlib import contextmanager
from typing import Iterator


def patch_language_once_per_launch() -> None:
    """Let a kernel launch patch triton.language once, not again at every device-function call.

    The interpreter swaps triton.language's builtins for interpreted ones when a launch starts and
    puts them back when it ends; every call of a @triton.jit device function inside the kernel
    scans the language modules again (inspect.getmembers), finds them already swapped, and so
    changes nothing, yet that scan took much of the interpreter's time in the radix-select
    kernels (32 passes of small device functions per program). Skipped here when every language
    module the function sees is swapped already (its `load` is then no builtin); a module seen
    for the first time (triton.language.core, from the standard library's jit functions) is
    patched as before.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    if getattr(original, "once_per_launch", False):
        return

    langs_of: dict[int, list] = {}  # id of a function's globals -> the language modules among them

    def patch_lang(fn):
        langs = langs_of.get(id(fn.__globals__))
        if langs is None:
            langs = langs_of[id(fn.__globals__)] = [value for value in fn.__globals__.values()
                                                    if inspect.ismodule(value) and value in (tl, tl.core)]
        if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):  # every one already swapped
            return interpreter._LangPatchScope()
        return original(fn)

    patch_lang.once_per_launch = True
    interpreter._patch_lang = patch_lang


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

