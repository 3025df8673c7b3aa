"""In real ComfyUI (COMFYUI_PATH, CPU, tiny random H3): ComfyUI's own attention as a candidate of the dense steps.

A stand-in for the attention ComfyUI binds at launch replaces ``optimized_attention`` of ComfyUI's H3
module, wrapped by ComfyUI's own ``wrap_attn`` (so our override receives it as ComfyUI hands it
over). It returns PyTorch attention's output times a recognisable factor; the measured choice's timer
is stubbed to time it faster or slower than SDPA (CPU timings at this size are noise). Our node with
every step dense must then return exactly what ComfyUI's own attention returns when it is the fastest
candidate within the run's bound, and SDPA's output otherwise.
"""
from __future__ import annotations

import logging

import pytest
import torch

from comfyui_harness import CKPT, comfy, needs_comfyui, sample, sparse  # noqa: F401

from adaptive_sparse_attention.kernels.dense import choice as dense
from adaptive_sparse_attention.nodes.model_patches import hooks_of

pytestmark = needs_comfyui
ATTENTION = "comfy.ldm.modules.attention"


class Launch:
    """ComfyUI as if launched with a stand-in attention: `install` patches it in, `timer` times it."""

    def __init__(self, monkeypatch, name: str, module: str, factor: float, standin_ms: float):
        import comfy.ldm.minimax.model as h3
        import comfy.ldm.modules.attention as attention

        self.calls: list[dict] = []
        self.standin_ms = standin_ms
        pytorch = attention.attention_pytorch.__wrapped__

        def standin(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                    **kwargs):
            self.calls.append(kwargs)
            return pytorch(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                           skip_output_reshape=skip_output_reshape, **kwargs) * factor

        standin.__module__, standin.__qualname__, standin.__name__ = module, name, name
        self.identity = f"{module}.{name}"
        monkeypatch.setattr(h3, "optimized_attention", attention.wrap_attn(standin))
        monkeypatch.setattr(dense, "median_ms", lambda fn, device, warmup=1, reps=3: self.timer(fn))

    def timer(self, fn) -> float:
        before = len(self.calls)
        fn()
        return self.standin_ms if len(self.calls) > before else 2.0


def dense_run(nodes, model, **changes):
    """Every step dense through our override; returns (latent, the run's report)."""
    patched = sparse(model, warmup_mode="dense", **changes)
    out = sample(nodes, patched)
    return out, hooks_of(patched)[0].tracker.last_report


@pytest.mark.parametrize("standin_ms,chosen", [(1.0, True), (3.0, False)], ids=["faster", "slower"])
def test_comfyui_attention_runs_the_dense_steps_when_it_is_the_fastest(comfy, monkeypatch, caplog, standin_ms, chosen):
    _, nodes = comfy
    factor = 1 + 2 ** -12  # relative error 2.4e-4: within a bf16 run's bound at float32 (1.2e-3)
    launch = Launch(monkeypatch, "attention_standin", "some_launch", factor, standin_ms)
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    plain = sample(nodes, model)  # ComfyUI without our node: the stand-in runs every block
    assert launch.calls
    launch.calls.clear()
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        ours, report = dense_run(nodes, model)
    assert all(kw.get("_inside_attn_wrapper") is True and "transformer_options" in kw for kw in launch.calls)
    assert report["precision"] == "bf16" and "some_launch.attention_standin, which is not 8-bit" in \
        report["precision_reason"]
    if chosen:
        assert torch.equal(ours, plain)  # its output is what the dense steps return
        assert report["dense_kernels"] == {f"ComfyUI's attention {launch.identity}": 16}
    else:
        assert not torch.equal(ours, plain)
        torch.testing.assert_close(ours, plain, rtol=1e-3, atol=1e-3)
        assert report["dense_kernels"] == {"SDPA's own choice": 16}
    said = [r.getMessage() for r in caplog.records]
    assert any("precision bf16 (auto: ComfyUI runs some_launch.attention_standin" in m for m in said), said
    assert any(m.startswith("dense kernels measured") and launch.identity in m for m in said), said
    summary = [m for m in said if "dense attention on" in m]
    assert summary
    assert ("ComfyUI's attention" in summary[-1]) is chosen


def test_an_8bit_launch_runs_its_attention_under_auto_and_not_under_bf16(comfy, monkeypatch):
    """A stand-in named as ComfyUI's Sage attention (``--use-sage-attention``): `auto` resolves 8-bit and
    its output (off by 2e-3, beyond a bf16 run's bound, within an 8-bit run's 4e-3 at float32) runs the
    dense steps; precision=bf16 refuses it as a candidate and runs SDPA."""
    _, nodes = comfy
    factor = 1 + 2 ** -9
    launch = Launch(monkeypatch, "attention_sage", ATTENTION, factor, 1.0)
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    plain = sample(nodes, model)
    auto, report = dense_run(nodes, model)
    assert report["precision"] == "8-bit"
    assert "--use-sage-attention" in report["precision_reason"]
    assert torch.equal(auto, plain)
    assert report["dense_kernels"] == {f"ComfyUI's attention {launch.identity}": 16}
    launch.calls.clear()
    bf16, report = dense_run(nodes, model, precision="bf16")
    assert report["precision"] == "bf16"
    assert report["precision_reason"] == "precision=bf16 on the node"
    assert report["dense_kernels"] == {"SDPA's own choice": 16}
    # the stand-in still runs where ComfyUI calls it outside the DiT blocks (the text refiner), never for them
    assert not any("optimized_attention_override" in kw.get("transformer_options", {}) for kw in launch.calls)
    assert not torch.equal(bf16, plain)
