"""The Raylight adapter in one process: the processor's call contract, its refusals, the worker patch.

The processor is called as Raylight's inner-attention dispatcher calls it (tests/raylight_mirror.py):
``processor(dense, q, k, v, transformer_options=..., **xFuser's ring keywords)``. Float64 with the
torch reference kernel, so outputs match the single-process engine to 1e-12.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from adaptive_sparse_attention import sparse_attention
from adaptive_sparse_attention.nodes.model_patches import BlockReplacement
from adaptive_sparse_attention.nodes.block_hook import CallContext, Mark
from adaptive_sparse_attention.nodes import raylight
from adaptive_sparse_attention.nodes.raylight import (RaylightSparseAttention, parallel_degrees, patch_worker_model,
                                                      worker_patch)
from h3_block import MiniMaxH3Model, layout_of
from comfyui_harness import COMFYUI, needs_comfyui
from h3_harness import PACKED, config
from raylight_mirror import INNER_ATTENTION_KEY, ring_keywords, set_inner_attention

HEADS, DEGREE, DIM = 4, 2, 32  # PACKED: 267 rows, one padding row at 2 ranks


def rank_one_inputs() -> tuple[list[torch.Tensor], torch.Tensor]:
    """q, k, v of rank 1 after the all-to-all ([1, 268, 2, D], zero padding row) and the whole-model output."""
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, HEADS, PACKED.seq_len, DIM, generator=g, dtype=torch.float64) for _ in range(3)]
    whole = sparse_attention(*full, layout_of(PACKED), config())
    local = [torch.cat([t[:, 2:].transpose(1, 2), t.new_zeros(1, 1, 2, DIM)], dim=1) for t in full]
    return local, whole[:, 2:].transpose(1, 2)


def call(processor, q, k, v, options: dict, **keywords):
    """Call the processor as Raylight's dispatcher does; the dense stand-in records its keywords."""
    seen = []

    def dense(a, b, c, **o):
        seen.append(o)
        return torch.full_like(a, 7.0)
    out = processor(dense, q, k, v, transformer_options=options, **{**ring_keywords(None), **keywords})
    return out, seen


def marked(processor, layer: int = 0) -> dict:
    """A block's options as our block replacement marks a sparse call (step 3)."""
    return {processor.key: Mark(layer, (3, layout_of(PACKED)), None, CallContext(processor, None))}


def decide(processor, attn, args: dict, layer: int = 0):
    """`decide` with the call context the DIFFUSION_MODEL wrapper would give this call (on a stand-in for the
    diffusion model, which holds the layouts of its calls)."""
    model = types.SimpleNamespace()
    return processor.decide(layer, attn, args, CallContext(processor, model,
                                                           *processor.tracker.step_of(args["transformer_options"])))


def test_marked_call_runs_the_rank_heads_like_one_gpu():
    (q, k, v), expected = rank_one_inputs()
    processor = RaylightSparseAttention(config(), HEADS, DEGREE)
    out, seen = call(processor, q, k, v, marked(processor))
    assert not seen
    torch.testing.assert_close(out[:, :PACKED.seq_len], expected, rtol=0, atol=1e-12)
    assert out[:, PACKED.seq_len:].abs().max() == 0
    scaled, _ = call(processor, q, k, v, marked(processor), softmax_scale=DIM ** -0.5)  # H3's own scale is accepted
    torch.testing.assert_close(scaled, out, rtol=0, atol=0)
    s = processor.tracker.stats
    assert (s.sparse_blocks, s.dense_blocks) == (2, 0)
    assert len(processor.tracker.densities) == 1


def test_unmarked_calls_are_raylight_dense_attention_unchanged():
    (q, k, v), _ = rank_one_inputs()
    processor = RaylightSparseAttention(config(), HEADS, DEGREE)
    # a model call's own options hold the CallContext under the same key: not a mark
    for options in ({}, {processor.key: CallContext(processor, None)}):
        out, seen = call(processor, q, k, v, options)
        assert seen == [ring_keywords(None)]
        assert bool((out == 7.0).all())


@pytest.mark.parametrize("keywords,message", [
    (dict(causal=True), "xFuser passed causal=True; sparse attention runs only with causal=False"),
    (dict(q_descale=torch.ones(1)), r"q_descale=a tensor of shape \(1,\)"),
    (dict(joint_tensor_key=torch.ones(1, 2, 2, DIM)), "joint_tensor_key"),
    (dict(window_size=[4, 4]), r"window_size=\[4, 4\]"),
    (dict(softmax_scale=0.5), "softmax_scale=0.5; sparse attention uses head_dim"),
])
def test_unsupported_xfuser_calls_say_why_and_strict_raises(keywords, message, caplog):
    (q, k, v), _ = rank_one_inputs()
    processor = RaylightSparseAttention(config(), HEADS, DEGREE)
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        out, seen = call(processor, q, k, v, marked(processor, layer=5), **keywords)
    assert len(seen) == 1
    assert bool((out == 7.0).all())
    assert any("layer 5 runs dense: " in r.getMessage() for r in caplog.records)
    assert any(re.search(message, r.getMessage()) for r in caplog.records)
    assert processor.tracker.stats.dense_blocks == 1
    with pytest.raises(RuntimeError, match=r"layer 5 runs dense: .*" + message + r".*\(strict mode\)"):
        strict = RaylightSparseAttention(config(strict=True), HEADS, DEGREE)
        call(strict, q, k, v, marked(strict, layer=5), **keywords)


def test_shapes_that_do_not_fit_the_layout_are_refused():
    (q, k, v), _ = rank_one_inputs()
    strict = RaylightSparseAttention(config(strict=True), HEADS, DEGREE)
    with pytest.raises(RuntimeError, match=r"q has shape \(1, 267, 2, 32\), expected \[B, 268, 2, D\]"):
        call(strict, q[:, :267], k[:, :267], v[:, :267], marked(strict))
    with pytest.raises(RuntimeError, match=r"q has shape \(1, 268, 1, 32\).*4 heads over 2 ranks"):
        call(strict, q[:, :, :1], k[:, :, :1], v[:, :, :1], marked(strict))
    with pytest.raises(RuntimeError, match=r"head_dim=16 is not supported"):
        call(strict, q[..., :16], k[..., :16], v[..., :16], marked(strict))


def block_call(rows: int, step: int = 3, packed=PACKED) -> dict:
    sched = torch.linspace(1.0, 0.0, 11, dtype=torch.float64)
    options = {"sigmas": sched[step:step + 1].float(), "sample_sigmas": sched.float()}
    if packed is not None:
        options["minimax_h3_layout"] = packed
    return {"img": torch.zeros(rows, 32, dtype=torch.float64), "transformer_options": options}


def test_decide_uses_the_whole_sequence_and_checks_the_shard(caplog):
    attn = MiniMaxH3Model(layers=1, heads=HEADS, head_dim=DIM).blocks[0].attn
    # min_tokens counts the whole sequence (267 rows), not the rank's 134
    processor = RaylightSparseAttention(config(min_tokens=200), HEADS, DEGREE)
    step, layout = decide(processor, attn, block_call(134))
    assert step == 3
    assert layout == layout_of(PACKED)
    assert decide(RaylightSparseAttention(config(min_tokens=268), HEADS, DEGREE), attn, block_call(134)) is None
    fidelity = RaylightSparseAttention(config(warmup_mode="fidelity"), HEADS, DEGREE)
    assert decide(fidelity, attn, block_call(134, step=0)) is None
    assert fidelity.tracker.stats.dense_blocks == 1
    assert not fidelity.tracker.notices  # warmup is no failure

    strict = RaylightSparseAttention(config(strict=True), HEADS, DEGREE)
    with pytest.raises(RuntimeError, match=r"block input of shape \(100, 32\) is not 1/2 of the layout's 267 rows "
                                           r"padded to 268"):
        decide(strict, attn, block_call(100))
    with pytest.raises(RuntimeError, match="the packed-sequence layout was not found"):
        decide(strict, attn, block_call(134, packed=None))
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        assert decide(processor, attn, block_call(100), layer=1) is None
    assert any("layer 1 runs dense: block input of shape (100, 32)" in r.getMessage() for r in caplog.records)


def fake_xfuser(monkeypatch, ulysses: int, ring: int, initialized: bool = True) -> None:
    for name in ("xfuser", "xfuser.core", "xfuser.core.distributed"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    state = sys.modules["xfuser.core.distributed"]
    state.get_ulysses_parallel_world_size = lambda: ulysses
    state.get_ring_parallel_world_size = lambda: ring
    state.model_parallel_is_initialized = lambda: initialized


def fake_raylight(monkeypatch) -> None:
    """Raylight's inner-attention module (the part the adapter imports)."""
    for name in ("raylight", "raylight.distributed_modules", "raylight.distributed_modules.inner_attention"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    slot = sys.modules["raylight.distributed_modules.inner_attention"]
    slot.INNER_ATTENTION_KEY, slot.set_inner_attention = INNER_ATTENTION_KEY, set_inner_attention


class Patcher:
    """The ModelPatcher surface the worker patch reads before it changes anything."""

    def __init__(self, diffusion_model):
        self.diffusion_model, self.model_options = diffusion_model, {"transformer_options": {}}

    def get_model_object(self, name: str):
        assert name == "diffusion_model"
        return self.diffusion_model


def test_worker_patch_routes_and_refuses(monkeypatch):
    model = MiniMaxH3Model(layers=1, heads=HEADS, head_dim=DIM)
    monkeypatch.setattr(raylight, "apply_sparse_attention", lambda m, c: ("single-gpu patch", c))
    assert parallel_degrees() == (1, 1)  # no xFuser here
    assert patch_worker_model(Patcher(model), config()) == ("single-gpu patch", config())
    fake_xfuser(monkeypatch, 2, 2, initialized=False)
    assert parallel_degrees() == (1, 1)
    fake_xfuser(monkeypatch, 2, 2)
    assert parallel_degrees() == (2, 2)
    with pytest.raises(ValueError, match="ring_degree=2 is not supported"):
        patch_worker_model(Patcher(model), config())
    fake_xfuser(monkeypatch, 3, 1)
    with pytest.raises(ValueError, match="ulysses_degree=3 is not supported: it must divide the model's 4 attention "
                                         "heads, one of 1, 2, 4"):
        patch_worker_model(Patcher(model), config())
    fake_xfuser(monkeypatch, 2, 1)
    with pytest.raises(RuntimeError, match=r"needs Raylight's inner-attention interface .*update Raylight"):
        patch_worker_model(Patcher(model), config())
    with pytest.raises(ValueError, match="only patches ComfyUI's MiniMax-H3 model"):
        patch_worker_model(Patcher(torch.nn.Linear(2, 2)), config())


def test_worker_patch_ships_by_value_and_loads_the_package_from_its_folder():
    """Ray workers cannot import ComfyUI's custom-node folders: the pickled patch loads the package itself."""
    cloudpickle = pytest.importorskip("cloudpickle")
    payload = cloudpickle.dumps(worker_patch(config(topk_ratio=0.4, dense_layers="1,3")))
    script = (
        "import pickle, sys\n"
        "patch = pickle.loads(sys.stdin.buffer.read())\n"
        "try:\n"
        "    patch(None, None)\n"
        "except AttributeError as err:\n"  # no ModelPatcher: it got as far as patch_worker_model
        "    assert 'get_model_object' in str(err), err\n"
        "m = sys.modules['adaptive_sparse_attention']\n"
        "print(m.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script], input=payload, capture_output=True, env=env, timeout=120,
                          cwd="/")
    assert done.returncode == 0, done.stderr.decode()
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(raylight.__file__)))
    assert done.stdout.decode().strip() == os.path.join(package_dir, "__init__.py")




@needs_comfyui
def test_worker_patch_on_a_real_model_patcher(monkeypatch):
    monkeypatch.syspath_prepend(COMFYUI)
    import comfyui_stubs

    comfyui_stubs.apply()
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    import comfy.model_patcher
    import comfy.patcher_extension as pe

    container = torch.nn.Module()
    container.diffusion_model = MiniMaxH3Model(layers=2, heads=HEADS, head_dim=DIM)
    patcher = comfy.model_patcher.ModelPatcher(container, torch.device("cpu"), torch.device("cpu"))
    earlier = lambda args, extra: extra["original_block"](args)  # noqa: E731  (another node's block patch)
    patcher.set_model_patch_replace(earlier, "dit", "double_block", 1)
    fake_xfuser(monkeypatch, 2, 1)
    fake_raylight(monkeypatch)
    patched = patch_worker_model(patcher, config())
    options = patched.model_options["transformer_options"]
    processor = options[INNER_ATTENTION_KEY]
    assert isinstance(processor, RaylightSparseAttention)
    assert (processor.heads, processor.degree) == (HEADS, 2)
    assert INNER_ATTENTION_KEY not in patcher.model_options["transformer_options"]  # the input is untouched
    marks = options["patches_replace"]["dit"]
    assert sorted(marks) == [("double_block", 0), ("double_block", 1)]
    assert all(isinstance(m, BlockReplacement) and m.key == processor.key and m.via_args is None for m in marks.values())
    assert patched.get_attachment(processor.key) is processor
    assert marks[("double_block", 1)].previous is earlier
    assert processor.key in patched.wrappers[pe.WrappersMP.DIFFUSION_MODEL]
    assert processor.key in patched.callbacks[pe.CallbacksMP.ON_CLEANUP]
    assert not patched.object_patches  # Raylight's attn.forward stays in place
