"""Capture files round-trip exactly and through `evaluate`."""
import dataclasses

import pytest
import torch

pytest.importorskip("safetensors")

from adaptive_sparse_attention import SequenceLayout, SparseConfig, sparse_attention  # noqa: E402
from adaptive_sparse_attention.nodes.capture import load_capture, save_capture  # noqa: E402
from adaptive_sparse_attention.bench.metrics import output_errors  # noqa: E402
from adaptive_sparse_attention.bench.scenes import SIZES, make_scene  # noqa: E402
from adaptive_sparse_attention.bench.cli import evaluate_file, main  # noqa: E402

TINY = dataclasses.replace(SIZES["cpu-small"], text=16, audio=24, grid=(4, 8, 12), heads=2, head_dim=64)


def test_round_trip_keeps_tensors_layout_and_meta(tmp_path):
    layout = SequenceLayout.from_segments([(0, 7, "text"), (7, 7 + 2 * 3 * 5, "ref_img", (2, 3, 5)),
                                           (37, 37 + 3 * 2 * 2, "video", (3, 2, 2))])
    g = torch.Generator().manual_seed(0)
    entries = [{"layer": layer, "step": step, **{n: torch.randn(1, 3, layout.total, 32, generator=g).to(dtype)
                                                 for n in "qkv"}}
               for layer, step, dtype in ((0, 0, torch.bfloat16), (17, 4, torch.float32))]
    path = str(tmp_path / "cap.safetensors")
    save_capture(path, entries, layout, {"model": "tiny", "sigma": 0.5})
    loaded, layout2, meta = load_capture(path)
    assert layout2 == layout
    assert meta == {"model": "tiny", "sigma": 0.5}
    assert [(e["layer"], e["step"]) for e in loaded] == [(0, 0), (17, 4)]
    for a, b in zip(entries, loaded):
        for n in "qkv":
            assert b[n].dtype == a[n].dtype
            assert torch.equal(a[n], b[n])


def test_bad_capture_input_raises(tmp_path):
    layout = SequenceLayout.from_segments([(0, 4, "text"), (4, 8, "video", (1, 2, 2))])
    x = torch.zeros(1, 1, 8, 32)
    with pytest.raises(ValueError, match="lacks"):
        save_capture(str(tmp_path / "a.safetensors"), [{"layer": 0, "q": x, "k": x, "v": x}], layout)
    with pytest.raises(ValueError, match=r"\[B, H, 8, D\]"):
        save_capture(str(tmp_path / "a.safetensors"), [{"layer": 0, "step": 0, "q": x[:, :, :5], "k": x, "v": x}], layout)
    from safetensors.torch import save_file

    save_file({"x": x}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a capture file"):
        load_capture(str(tmp_path / "other.safetensors"))


def test_capture_round_trips_through_evaluate(tmp_path, capsys):
    """evaluate on a saved scene gives the numbers computed directly on the original tensors."""
    scene = make_scene("cuts", TINY, seed=2)
    path = str(tmp_path / "scene.safetensors")
    save_capture(path, [{"layer": 3, "step": 1, "q": scene.q, "k": scene.k, "v": scene.v}], scene.layout)
    rows = evaluate_file(path, ["dense", "ours:cube:reweight:query"], [0.2], torch.device("cpu"), "torch", 16)
    ours = next(r for r in rows if r["method"] == "ours:cube:reweight:query")
    assert ours["case"] == "L3s1"
    ref = torch.nn.functional.scaled_dot_product_attention(scene.q, scene.k, scene.v)
    out = sparse_attention(scene.q, scene.k, scene.v, scene.layout, SparseConfig(topk_ratio=0.2, tiling="cube"))
    direct = output_errors(out, ref, scene.layout)
    assert ours["rel_l2"] == pytest.approx(direct["video"]["rel_l2"], rel=1e-6)
    assert ours["ctx_rel_l2"] < 1e-5
    assert 0 < ours["recall"] < 1
    assert main(["evaluate", path, "--methods", "dense,ours:cube:none:query", "--ratios", "0.3", "--device", "cpu",
                 "--rows", "8"]) == 0
    assert "| L3s1 | ours:cube:none:query | 0.300 |" in capsys.readouterr().out
