"""Shared fixtures.

One Triton mode per test process (see triton_interpreter.py). Without a GPU, Triton and the pack's
Triton kernel modules are first imported here under the interpreter, so the kernel tests pass in any
order and selection, also after a module that imports the package's nodes (and with them Triton) or
resolves kernels for a stand-in CUDA device first; the interpreter
patches Triton's language once per kernel launch (`patch_language_once_per_launch`). Where CUDA
is available Triton is first imported here compiled, test modules import kernels compiled
(`kernel_imports`), and `compiled_kernels_only` fails any test that finds or leaves a kernel
decorated by the interpreter or TRITON_INTERPRET set.

Interpreter tests (the `interpreter` fixture) skip where CUDA is available; their compiled twins:
test_block_select, test_block_stats -> test_gpu_kernels.py (route_blocks' exact selection, block
means, tail summaries) and test_streaming_routing.py (compiled there); test_triton_kernel,
test_cudnn_backend -> test_gpu_kernels.py's attention cases (cudnn where installed);
test_hostile_inputs' interpreter cases -> test_non_finite_inputs_stay_local_on_the_gpu, which also
runs the reblock kernels on the GPU (not compared there: test_reblock_features and
test_reblock_split's comparison on the GPU is tools/reblock_device_check.py, outside the suite);
test_eight_bit -> tools/eight_bit_check.py (outside the suite); test_head_choice's kernel cases,
test_no_recompile (it records interpreted launches) and test_first_use -> none (test_kernel_targets
compiles every kernel for the GPU archs).
Tests that use the `triton_device` fixture run on both: compiled on CUDA tensors, or interpreted.

Markers (pytest.ini): a test that uses the `interpreter` fixture is marked `interpreter` here (and
one that uses `triton_device` where there is no CUDA); a test marked `comfyui`
(`comfyui_harness.needs_comfyui`) is skipped unless COMFYUI_PATH holds a ComfyUI checkout.
"""
import importlib
import os
import pkgutil
from typing import Iterator

import pytest
import torch

from triton_interpreter import interpreted_kernels, kernel_imports, patch_language_once_per_launch

CUDA = torch.cuda.is_available()
GUARD_MODES = CUDA and os.environ.get("TRITON_INTERPRET") != "1"  # a run asked for the interpreter is not guarded

with kernel_imports():
    try:
        import triton  # noqa: F401
    except ImportError:  # the no-Triton paths are tested then
        pass
    else:
        if not CUDA:
            patch_language_once_per_launch()
            # every kernel module of the pack too: a test that resolves kernels for a stand-in CUDA device
            # would load them without TRITON_INTERPRET, which would decorate them compiled
            import adaptive_sparse_attention.kernels.triton as triton_kernels
            for module in pkgutil.iter_modules(triton_kernels.__path__):
                importlib.import_module(f"{triton_kernels.__name__}.{module.name}")


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET=1 while a test runs (Triton kernels on CPU tensors).

    Where CUDA is available Triton was imported compiled, so its kernels cannot take CPU tensors:
    these tests are skipped there, and tests/test_gpu_kernels.py checks the compiled kernels."""
    if CUDA:
        pytest.skip("Triton interpreter tests run on machines without CUDA (as CI); test_gpu_kernels.py "
                    "checks the compiled kernels here")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_device(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """Where this process runs Triton kernels: the CUDA GPU (compiled; put the test's tensors on
    it), else the CPU under the interpreter (TRITON_INTERPRET=1 while the test runs)."""
    if CUDA:
        return torch.device("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device("cpu")


@pytest.fixture(autouse=True)
def compiled_kernels_only() -> Iterator[None]:
    """Where CUDA is available: no test starts with, or leaves behind, a Triton function decorated
    by the interpreter (compiled code cannot call one, and it copies CUDA tensors to the host) or
    TRITON_INTERPRET set (kernel modules imported then would be interpreted)."""
    if not GUARD_MODES:
        yield
        return
    found = interpreted_kernels()
    assert not found, f"{len(found)} interpreted Triton functions before this test (imported under " \
                      f"TRITON_INTERPRET=1), among them {found[:3]}"
    yield
    found = interpreted_kernels()
    assert not found, f"this test left {len(found)} interpreted Triton functions (imported under " \
                      f"TRITON_INTERPRET=1), among them {found[:3]}"
    assert os.environ.get("TRITON_INTERPRET") != "1", "this test left TRITON_INTERPRET=1 set"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_comfyui = os.path.isfile(os.path.join(os.environ.get("COMFYUI_PATH", ""), "main.py"))
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "interpreter" in fixtures or ("triton_device" in fixtures and not CUDA):
            item.add_marker(pytest.mark.interpreter)
        if item.get_closest_marker("comfyui") is not None and not has_comfyui:
            item.add_marker(pytest.mark.skip(reason="set COMFYUI_PATH to a ComfyUI checkout to run these tests"))
