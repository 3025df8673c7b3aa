"""Triton's interpreter for the kernel tests (CPU tensors, no GPU), and one mode per process.

Triton decorates a function when its module is first imported: interpreted under
TRITON_INTERPRET=1, compiled otherwise, and the two cannot mix (an interpreted kernel takes no
CUDA tensor into compiled code, a compiled one no CPU tensor; gluon asserts that Triton's own
library is compiled). So a test module imports kernels inside `kernel_imports()`: interpreted on a
machine without CUDA (where the `interpreter` fixture's tests run them on CPU tensors), compiled
where CUDA is available (where those tests skip and the GPU tests use the same module objects).
TRITON_INTERPRET is put back afterwards because other test modules check the no-GPU paths; the
`interpreter` fixture (conftest.py) sets it around each interpreter test (the launchers and the
dispatcher read it at call time). `interpreted_kernels` lists what a CUDA run must never hold.

`patch_language_once_per_launch` makes the interpreter cheaper without changing what it runs.
"""
import inspect
import os
import sys
from contextlib import contextmanager, nullcontext
from typing import ContextManager, Iterator

import torch


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



def kernel_imports() -> ContextManager[None]:
    """Around a test module's imports of Triton (and kernel modules, and its own kernels): the
    interpreter where CUDA is unavailable, nothing (compiled kernels) where it is available."""
    return nullcontext() if torch.cuda.is_available() else interpreter_env()


def interpreted_kernels() -> list[str]:
    """Names of the Triton functions decorated by the interpreter in the imported kernel modules
    (any package's ``kernels.triton`` modules, this one's test kernels excluded) and in Triton's
    own language library; [] where Triton was never imported."""
    if "triton" not in sys.modules:
        return []
    from triton.runtime.interpreter import InterpretedFunction

    return [f"{name}.{attr}" for name, module in list(sys.modules.items())
            if module is not None and (".kernels.triton." in name or name.startswith("triton.language"))
            for attr, value in list(vars(module).items()) if isinstance(value, InterpretedFunction)]
