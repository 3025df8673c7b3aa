"""The patched H3 blocks under torch.compile, as ComfyUI's TorchCompileModel node runs them (CPU).

TorchCompileModel compiles the whole diffusion model (our DIFFUSION_MODEL wrapper and block
patches included) and gives torch.compile a guard filter that drops every guard whose source
name mentions ``transformer_options``. The stand-in forward below has H3's structure: the
wrapper, a host read of the sigma before the blocks (H3's forward breaks the graph there too),
then the ``("dit", "double_block", i)`` patches looked up in ``transformer_options``, in a loop
that breaks the graph in every block, as H3's does (ComfyUI's weight prefetch queries the host's
memory there): dynamo then gives up on the loop's frame and compiles every call under it as a frame
of its own, guarded on its arguments, which is where a decision frozen at its first value (a dense
warmup step) would make every later step run it. Both upstream signatures are run: the block's
``attention`` argument (current) and the object-patched ``attn.forward`` (the pinned fork).
Graph breaks and recompiles are read from dynamo's logs over a whole run: dense warmup, then sparse.
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
from adaptive_sparse_attention.kernels.dense import choice as dense
from adaptive_sparse_attention.nodes.model_patches import DiffusionModelWrapper, block_hooks
from adaptive_sparse_attention.nodes.block_hook import bind
from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook
from h3_block import PackedLayout, block_args, block_wrap
from h3_harness import PACKED, Executor, config, model_of, options, set_path

STEPS = 3  # 1 warmup step (dense), then sparse
PACKAGE = os.path.realpath(os.path.dirname(adaptive_sparse_attention.__file__)) + os.sep  # wherever it is checked out


def drop_transformer_options_guards(entries) -> list[bool]:
    """What TorchCompileModel's guard filter keeps: guards whose name does not mention transformer_options."""
    return [e.name.find("transformer_options") < 0 for e in entries]


LONGER = PackedLayout(5, 6, 16, 16, 3)  # a new clip length: 6 latent frames instead of 4


def run(hook: SparseAttentionHook, backend=None, new: bool = True, packed: tuple = (PACKED,),
        dynamic: bool | None = None) -> tuple[list[torch.Tensor], dict]:
    """Outputs of STEPS model calls per layout in `packed` (compiled with `backend` and `dynamic`
    when a backend is given) and the last run's report; `new`: current upstream's block signature,
    else the pinned fork's."""
    model = model_of(new, seed=30).float()
    replacements, attn_patches = block_hooks(model, hook, {}, {})
    for key, fn in attn_patches.items():  # the pinned fork: ModelPatcher object patches of attn.forward
        set_path(model, key, fn)
    patches = {("double_block", i): fn for i, fn in replacements.items()}

    def h3_forward(x, timestep, context, transformer_options, minimax_payload=None):
        layout = minimax_payload["layout"]
        args = block_args(model.blocks[0], layout, seed=31, new=new, dtype=torch.float32)
        sigma = float(timestep.flatten()[0])  # H3 reads its sigma on the host: a graph break before the blocks
        h = args["img"] * (1.0 + sigma)
        dit = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(model.blocks):
            torch._dynamo.graph_break()  # as H3's weight prefetch in its block loop
            call = {**args, "img": h, "transformer_options": transformer_options}
            h = dit[("double_block", i)](call, {"original_block": block_wrap(block, new)})["img"]
        return h

    wrapper = DiffusionModelWrapper(hook.key)
    bind(model, hook)

    def forward(x, timestep, context, transformer_options, minimax_payload=None):
        return wrapper(Executor(model, h3_forward), x, timestep, context, transformer_options,
                       minimax_payload=minimax_payload)

    if backend is not None:
        forward = torch.compile(forward, backend=backend, dynamic=dynamic,
                                options={"guard_filter_fn": drop_transformer_options_guards})
    outs = []
    with torch.no_grad():
        for layout in packed:
            text, t, h, w, audio = layout.signature
            x = [torch.zeros(1, 24, t, h, w), torch.zeros(1, 32, 2, audio)]
            for step in range(STEPS):
                to = options(step, STEPS, patches_replace={"dit": patches})
                outs.append(forward(x, to["sigmas"], torch.zeros(1, text, 48), to, minimax_payload={"layout": layout}))
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
def dynamo_log() -> Iterator[dict[str, set]]:
    """Collects, of the package's own code (not tests), the (file, function) of every graph break
    and of every recompiled frame that dynamo logs meanwhile, and all recompiles (function, file, line)."""
    found: dict[str, set] = {"breaks": set(), "recompiled": set(), "all_recompiles": []}
    broke = re.compile(r"Graph break .*?in user code at (\S+):(\d+)")
    recompiled = re.compile(r"Recompiling function (\S+) in (\S+):(\d+)")

    def ours(path: str) -> str | None:
        """The path inside the package, or None for tests and anything else (a venv in the checkout too)."""
        path = os.path.realpath(path)
        rel = path[len(PACKAGE):] if path.startswith(PACKAGE) else None
        if rel is None or rel.split(os.sep)[0] in ("tests", ".venv") or "site-packages" in rel:
            return None
        return rel

    class Sites(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if m := broke.match(message):
                if (rel := ours(m[1])) is not None:
                    found["breaks"].add((rel, function_at(m[1], int(m[2]))))
            elif m := recompiled.search(message):
                found["all_recompiles"].append((m[1], os.path.basename(m[2]), int(m[3])))
                if (rel := ours(m[2])) is not None:
                    found["recompiled"].add((rel, m[1]))

    handler = Sites()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


@pytest.fixture
def dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.mark.slow  # four compiled sampling runs of the stand-in model
@pytest.mark.parametrize("dynamic", [None, True], ids=["dynamic-default", "dynamic-on"])
@pytest.mark.parametrize("new", [True, False], ids=["current-upstream", "pinned-fork"])
def test_compiled_run_matches_eager_step_by_step_and_recompiles_once_per_new_length(dynamo, new, dynamic):
    cfg = config(warmup_mode="fidelity", warmup_ratio=0.2)  # step 0 dense, steps 1-2 sparse
    eager, eager_report = run(SparseAttentionHook(cfg), new=new)
    eager += run(SparseAttentionHook(cfg), new=new, packed=(LONGER,))[0]
    with dynamo_log() as log:
        compiled, report = run(SparseAttentionHook(cfg), "eager", new=new, dynamic=dynamic)
    with dynamo_log() as longer:
        compiled += run(SparseAttentionHook(cfg), "eager", new=new, packed=(LONGER,), dynamic=dynamic)[0]
    # every step runs what it runs eagerly: the sparse steps are not the dense warmup step's graph
    assert len(compiled) == len(eager) == 2 * STEPS
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    # the report counts and measures the compiled run as the eager one
    for key in ("steps_sparse", "steps_dense", "blocks_sparse", "blocks_dense", "dense_reasons", "mean_density"):
        assert report[key] == eager_report[key], key
    assert report["blocks_sparse"] == 2 * (STEPS - 1)
    assert 0 < report["mean_density"] < 1
    # the package breaks the graph only in the frames it keeps eager, and none of its frames recompiles
    assert log["breaks"] <= {("nodes/model_patches.py", "__call__"), ("nodes/block_hook.py", "begin_call")}
    assert not log["recompiled"], log["recompiled"]  # steps and blocks of one length: nothing
    # within one length the stand-in's own frames compile a dense and a sparse variant at most (the
    # block args differ); a new clip length recompiles each variant of a frame at most once
    variants = {f: 1 + log["all_recompiles"].count(f) for f in log["all_recompiles"]}
    assert max(variants.values(), default=1) <= 2, log["all_recompiles"]
    again = longer["all_recompiles"]
    assert all(again.count(f) <= variants.get(f, 1) for f in again), (variants, sorted(again))
    assert all(again.count(f) <= 1 for f in again if f[1] in {"model_patches.py", "block_hook.py"}), again


def test_a_measured_dense_kernel_choice_is_read_without_a_graph_break(dynamo, tmp_path):
    """Compiled dense blocks on a GPU make their key and look their kernel up in every call (the
    first use takes a lock and measures)."""
    choices = dense.DenseChoices(tmp_path / "choices.json")
    choices.devices[None] = "a GPU"  # the key's device part, as computed once per device
    q = torch.ones(1, 2, 5, 8)
    choices.remember(choices.key(q, q, q), "flash")

    def lookup(x):
        return x * len(choices.lookup(choices.key(x, x, x), lambda: pytest.fail("not in memory")))

    with dynamo_log() as log:
        out = torch.compile(lookup, backend="eager")(q)
    assert out.flatten()[0].item() == 5.0
    assert not log["breaks"]
