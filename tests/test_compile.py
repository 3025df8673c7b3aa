"""The patched H3 blocks under torch.compile, as ComfyUI's TorchCompileModel node runs them (CPU).

TorchCompileModel compiles the whole diffusion model (our DIFFUSION_MODEL wrapper and block
patches included) and gives torch.compile a guard filter that drops every guard whose source
name mentions ``transformer_options``. The stand-in forward below has H3's structure: the
wrapper, a host read of the sigma before the blocks (H3's forward breaks the graph there too),
then the ``("dit", "double_block", i)`` patches looked up in ``transformer_options``. Graph
breaks are read from dynamo's graph-break log over a whole run: dense warmup, then sparse.
"""
from __future__ import annotations

import ast
import logging
import os
import re
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

import adaptive_sparse_attention
from adaptive_sparse_attention.kernels import dense
from adaptive_sparse_attention.nodes.block_patches import DiffusionModelWrapper, block_hooks
from adaptive_sparse_attention.nodes.hooks import bind
from adaptive_sparse_attention.nodes.sparse_hook import SparseAttentionHook
from h3_block import block_args, block_wrap
from h3_harness import PACKED, Executor, config, model_of, options

STEPS = 3  # 1 warmup step (dense), then sparse
PACKAGE = os.path.realpath(os.path.dirname(adaptive_sparse_attention.__file__)) + os.sep  # wherever it is checked out
WRAPPER = ("nodes/block_patches.py", "__call__")  # DiffusionModelWrapper: begin_call  # begin_call: the step, on the host, once per call


def drop_transformer_options_guards(entries) -> list[bool]:
    """What TorchCompileModel's guard filter keeps: guards whose name does not mention transformer_options."""
    return [e.name.find("transformer_options") < 0 for e in entries]


def run(hook: SparseAttentionHook, backend=None) -> tuple[list[torch.Tensor], dict]:
    """Outputs of STEPS model calls (compiled with `backend` when given) and the run's report."""
    model = model_of(True, seed=30).float()
    args = block_args(model.blocks[0], PACKED, seed=31, new=True, dtype=torch.float32)
    replacements, _ = block_hooks(model, hook, {}, {})
    patches = {("double_block", i): fn for i, fn in replacements.items()}

    def h3_forward(x, timestep, context, transformer_options, minimax_payload=None):
        sigma = float(timestep.flatten()[0])  # H3 reads its sigma on the host: a graph break before the blocks
        h = args["img"] * (1.0 + sigma)
        dit = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(model.blocks):
            call = {**args, "img": h, "layout": minimax_payload["layout"], "transformer_options": transformer_options}
            h = dit[("double_block", i)](call, {"original_block": block_wrap(block, True)})["img"]
        return h

    wrapper = DiffusionModelWrapper(hook.key)
    bind(model, hook)

    def forward(x, timestep, context, transformer_options, minimax_payload=None):
        return wrapper(Executor(model, h3_forward), x, timestep, context, transformer_options,
                       minimax_payload=minimax_payload)

    if backend is not None:
        forward = torch.compile(forward, backend=backend, options={"guard_filter_fn": drop_transformer_options_guards})
    text, t, h, w, audio = PACKED.signature
    x = [torch.zeros(1, 24, t, h, w), torch.zeros(1, 32, 2, audio)]
    outs = []
    with torch.no_grad():
        for step in range(STEPS):
            to = options(step, STEPS, patches_replace={"dit": patches})
            outs.append(forward(x, to["sigmas"], torch.zeros(1, text, 48), to, minimax_payload={"layout": PACKED}))
    hook.tracker.finish()
    return outs, hook.tracker.last_report


def function_at(path: str, line: int) -> str:
    """Name of the innermost function of the file at `path` that holds `line`."""
    with open(path) as f:
        tree = ast.parse(f.read())
    spans = [(n.lineno, n.name) for n in ast.walk(tree)
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.lineno <= line <= n.end_lineno]
    return max(spans)[1] if spans else "<module>"


@contextmanager
def break_sites() -> Iterator[set[tuple[str, str]]]:
    """Collects (file in the package, function) of every graph break dynamo logs meanwhile."""
    sites: set[tuple[str, str]] = set()
    where = re.compile(r"Graph break .*?in user code at (\S+):(\d+)")

    class Sites(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            m = where.match(record.getMessage())
            path = os.path.realpath(m[1]) if m else ""
            if path.startswith(PACKAGE) and not path.startswith(PACKAGE + "tests" + os.sep):  # the package, not tests
                sites.add((path[len(PACKAGE):], function_at(path, int(m[2]))))

    handler = Sites()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(graph_breaks=True)
    logger.addHandler(handler)
    try:
        yield sites
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


@pytest.fixture
def dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_compiled_run_matches_eager_and_breaks_once_per_call(dynamo):
    cfg = config(warmup_mode="fidelity", warmup_ratio=0.2)  # step 0 dense
    eager, eager_report = run(SparseAttentionHook(cfg))
    with break_sites() as sites:
        compiled, report = run(SparseAttentionHook(cfg), "eager")
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    # the dense warmup step and the sparse steps are counted as in eager mode (decided per call, on the host)
    for key in ("steps_sparse", "steps_dense", "blocks_sparse", "blocks_dense", "dense_reasons"):
        assert report[key] == eager_report[key], key
    assert report["blocks_sparse"] == 2 * (STEPS - 1) == report["blocks_unmeasured"] and report["mean_density"] is None
    assert eager_report["blocks_unmeasured"] == 0
    # in our package the graph breaks only where the step is read (once per model call)
    assert sites == {WRAPPER}


def test_a_measured_dense_kernel_choice_is_read_without_a_graph_break(dynamo, tmp_path):
    """Compiled dense blocks on a GPU make their key and look their kernel up in every call (the
    first use takes a lock and measures)."""
    choices = dense.DenseChoices(tmp_path / "choices.json")
    choices.devices[None] = "a GPU"  # the key's device part, as computed once per device
    q = torch.ones(1, 2, 5, 8)
    choices.remember(choices.key(q, q, q), "flash")

    def lookup(x):
        return x * len(choices.lookup(choices.key(x, x, x), lambda: pytest.fail("not in memory")))

    with break_sites() as sites:
        out = torch.compile(lookup, backend="eager")(q)
    assert out.flatten()[0].item() == 5.0 and not sites
