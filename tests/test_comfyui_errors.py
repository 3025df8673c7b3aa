"""Real ComfyUI (COMFYUI_PATH, CPU, tiny random H3): the capture node captures in either order with our
sparse node, and a run on the torch reference kernel warns once per run and says so in its report."""
from __future__ import annotations

import logging

import torch

from comfyui_harness import CKPT, comfy, needs_comfyui, sample, sparse, summaries  # noqa: F401

pytestmark = needs_comfyui
REFERENCE = "sparse blocks run the pure-torch reference kernel"


def capture(model, prefix: str):
    from adaptive_sparse_attention.nodes.capture_node import CaptureH3Attention

    return CaptureH3Attention.execute(model, layers="0,1", steps="1,2", filename_prefix=prefix).result[0]


def captured(base, prefix: str) -> list[list[dict]]:
    from adaptive_sparse_attention.nodes.capture import load_capture

    files = sorted((base / "output").glob(f"{prefix}_*.safetensors"))
    assert [f.name.rsplit("_", 1)[1] for f in files] == ["step001.safetensors", "step002.safetensors"], files
    return [load_capture(str(f))[0] for f in files]


def test_capture_before_or_after_the_sparse_node_captures_the_same_and_sampling_is_unchanged(comfy, caplog):
    base, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        plain = sample(nodes, sparse(model))
        before = sample(nodes, sparse(capture(model, "order/before")))  # loader -> capture -> ours
        after = sample(nodes, capture(sparse(model), "order/after"))  # loader -> ours -> capture
    assert summaries(caplog) == [(1, 3, 4, 12)] * 3  # the sparse path ran in every order
    torch.testing.assert_close(before, plain, rtol=0, atol=0)
    torch.testing.assert_close(after, plain, rtol=0, atol=0)
    first, second = captured(base, "order/before"), captured(base, "order/after")
    for a, b in zip(first, second):
        assert [(e["layer"], e["step"]) for e in a] == [(e["layer"], e["step"]) for e in b]
        for x, y in zip(a, b):
            for n in "qkv":
                torch.testing.assert_close(x[n], y[n], rtol=0, atol=0)
    alone = sample(nodes, capture(model, "order/alone"))  # no sparse node: step 1's inputs follow a dense step 0
    for x, y in zip(captured(base, "order/alone")[0], first[0]):
        torch.testing.assert_close(x["q"], y["q"], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(alone).all()


def test_a_run_on_the_reference_kernel_warns_once_per_run_and_says_so_in_the_report(comfy, caplog):
    from adaptive_sparse_attention.nodes.report_node import report_text

    _, nodes = comfy
    patched = sparse(nodes.UNETLoader().load_unet(CKPT, "default")[0])
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        sample(nodes, patched)
        sample(nodes, patched)
    warned = [r for r in caplog.records if REFERENCE in r.getMessage()]
    assert len(warned) == 2 and all(r.levelno == logging.WARNING for r in warned)
    assert "the model runs on the CPU" in warned[0].getMessage()
    assert "Note: " + warned[0].getMessage().split(": ", 1)[1] in report_text(patched).splitlines()
