"""ComfyUI's ModelAttentionBackend node before or after ours, in real ComfyUI (COMFYUI_PATH, CPU, tiny random H3).

The node sets an ``optimized_attention_override`` that runs the attention function chosen from
ComfyUI's registered ones (``ModelPatcher.set_model_optimized_attention``). Its "comfy kitchen
attention" needs comfy-kitchen's INT8 attention, which this CPU lacks: a stand-in is registered the
way ComfyUI registers it (``register_attention_function("comfy_kitchen_int8", ...)``, named as
ComfyUI's ``attention_comfy_kitchen_int8`` and wrapped by its ``wrap_attn``). It returns PyTorch
attention's output times 1 + 2^-9 (beyond a bf16 run's bound, within an 8-bit run's); the dense
choice's timer is stubbed to time it fastest (CPU timings at this size are noise).

With the node in either order, `auto` resolves 8-bit from the choice, the dense steps run the
chosen function exactly as the model without our node does, and the sparse steps run at 8-bit;
`precision=bf16` refuses it as a candidate. "pytorch attention" chosen on a ComfyUI launched with
an 8-bit attention gives bf16: the model's choice wins over the launch, as it does in ComfyUI.
"""
from __future__ import annotations

import pytest
import torch

from comfyui_harness import CKPT, comfy, needs_comfyui, sample, sparse  # noqa: F401

from adaptive_sparse_attention.kernels.dense import choice as dense
from adaptive_sparse_attention.nodes.model_patches import hooks_of

pytestmark = needs_comfyui
ATTENTION = "comfy.ldm.modules.attention"
CK = f"{ATTENTION}.attention_comfy_kitchen_int8"
FACTOR = 1 + 2 ** -9


def named(fn, name: str, module: str = ATTENTION):
    fn.__module__, fn.__qualname__, fn.__name__ = module, name, name
    return fn


@pytest.fixture
def ck_standin(comfy, monkeypatch):
    """comfy-kitchen's INT8 attention registered as ComfyUI registers it; returns the list of its calls."""
    import comfy.ldm.modules.attention as attention

    calls: list[int] = []
    pytorch = attention.attention_pytorch.__wrapped__

    def attention_comfy_kitchen_int8(q, k, v, heads, **kwargs):
        calls.append(q.shape[-2] if kwargs.get("skip_reshape") else q.shape[1])
        return pytorch(q, k, v, heads, **kwargs) * FACTOR

    standin = attention.wrap_attn(named(attention_comfy_kitchen_int8, "attention_comfy_kitchen_int8"))
    monkeypatch.setattr(attention, "REGISTERED_ATTENTION_FUNCTIONS", dict(attention.REGISTERED_ATTENTION_FUNCTIONS))
    attention.register_attention_function("comfy_kitchen_int8", standin)

    def timer(fn, device, warmup=1, reps=3):  # the stand-in is the fastest candidate
        before = len(calls)
        fn()
        return 1.0 if len(calls) > before else 2.0
    monkeypatch.setattr(dense, "median_ms", timer)
    return calls


def backend(model, attention: str):
    from comfy_extras.nodes_model_advanced import ModelAttentionBackend

    return ModelAttentionBackend().patch(model, attention)[0]


def report(model) -> dict:
    return hooks_of(model)[0].tracker.last_report


@pytest.mark.parametrize("order", ["before", "after"])
def test_comfy_kitchen_attention_chosen_on_the_model_is_followed(comfy, ck_standin, order):
    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    plain = sample(nodes, backend(model, "comfy kitchen attention"))  # ComfyUI without our node
    assert ck_standin.count(529) == 16  # every DiT block call (4 steps x cfg 2 x 2 blocks) ran the choice

    def ours(**changes):
        if order == "before":
            return sparse(backend(model, "comfy kitchen attention"), **changes)
        return backend(sparse(model, **changes), "comfy kitchen attention")

    patched = ours(warmup_mode="dense")
    assert torch.equal(sample(nodes, patched), plain)  # the dense steps ran the chosen function, as without us
    got = report(patched)
    assert got["precision"] == "8-bit"
    assert got["precision_reason"] == (f"auto: the model's attention backend (ModelAttentionBackend) is {CK}, "
                                       "which is 8-bit")
    assert got["dense_kernels"] == {f"ComfyUI's attention {CK}": 16}

    bf16 = ours(warmup_mode="dense", precision="bf16")
    out = sample(nodes, bf16)
    assert report(bf16)["dense_kernels"] == {"SDPA's own choice": 16}  # the 8-bit choice is not a bf16 candidate
    assert not torch.equal(out, plain)

    mixed = ours(min_tokens=0)  # dense warmup, then sparse steps
    sample(nodes, mixed)
    got = report(mixed)
    assert got["precision"] == "8-bit" and got["steps_sparse"]
    assert hooks_of(mixed)[0].engine_config.precision == "8-bit"  # what the sparse steps ran at


def test_pytorch_attention_chosen_on_an_8bit_launch_gives_bf16(comfy, ck_standin, monkeypatch):
    """ComfyUI launched with an 8-bit attention (a stand-in bound as ``--use-sage-attention`` binds
    ``attention_sage``), the model set to "pytorch attention": `auto` is bf16 and the launch's
    function runs for no DiT block."""
    import comfy.ldm.minimax.model as h3
    import comfy.ldm.modules.attention as attention

    launch_calls = []

    def attention_sage(q, k, v, heads, **kwargs):
        launch_calls.append(q.shape[-2] if kwargs.get("skip_reshape") else q.shape[1])
        return attention.attention_pytorch.__wrapped__(q, k, v, heads, **kwargs)
    monkeypatch.setattr(h3, "optimized_attention", attention.wrap_attn(named(attention_sage, "attention_sage")))
    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    for patched in (sparse(backend(model, "pytorch attention"), warmup_mode="dense"),
                    backend(sparse(model, warmup_mode="dense"), "pytorch attention")):
        sample(nodes, patched)
        got = report(patched)
        assert got["precision"] == "bf16"
        assert got["precision_reason"] == (f"auto: the model's attention backend (ModelAttentionBackend) is "
                                           f"{ATTENTION}.attention_pytorch, which is not 8-bit")
        assert launch_calls.count(529) == 0
    assert ck_standin == []
