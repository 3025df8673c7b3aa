"""`evaluate` speaks to a user: a missing or wrong file is one line and exit code 2, each captured call
gets a verdict in words (pass / worse than the acceptance bound / incomplete, with what to do), and
comfy-kitchen's version is read as install.py reads it."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from adaptive_sparse_attention import SequenceLayout  # noqa: E402
from adaptive_sparse_attention.bench import methods  # noqa: E402
from adaptive_sparse_attention.bench.report import config_default_method, verdicts  # noqa: E402
from adaptive_sparse_attention.nodes.capture import capture_header, save_capture  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OURS = config_default_method()


def install_main():
    """install.py's `main`, imported from the repository root as ComfyUI-Manager's Python runs it."""
    spec = importlib.util.spec_from_file_location("asa_install_under_test", REPO / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_a_missing_or_wrong_file_is_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not a capture")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "weights.safetensors"))
    save_file({"0.q": torch.zeros(1)}, str(tmp_path / "cut.safetensors"),
              metadata={"format": "adaptive-sparse-attention/capture", "version": "1", "entries": "[]"})
    expected = {"missing.safetensors": "missing.safetensors: no such file",
                "notes.txt": "notes.txt is not a safetensors file",
                "weights.safetensors": "weights.safetensors is not a capture file",
                "cut.safetensors": "cut.safetensors has an incomplete capture header",
                ".": ". is not a file"}
    main = install_main()
    for name, text in expected.items():
        assert main(["evaluate", name]) == 2, name
        out, err = capsys.readouterr()
        assert out == "", name
        assert err.count("\n") == 1 and err.startswith(f"evaluate: {text}"), (name, err)
        assert 'written by the "Capture H3 Attention" node' in err


def test_the_header_is_checked_without_loading_tensors(tmp_path):
    layout = SequenceLayout.from_segments([(0, 4, "text"), (4, 4 + 2 * 2 * 2, "video", (2, 2, 2))])
    path = str(tmp_path / "c.safetensors")
    save_capture(path, [{"layer": 2, "step": 7, **{n: torch.randn(1, 1, layout.total, 8) for n in "qkv"}}], layout,
                 {"model": "t"})
    index, read_layout, meta = capture_header(path)
    assert index == [{"layer": 2, "step": 7}] and read_layout == layout and meta == {"model": "t"}


def row(case, method, ratio, **values):
    return {"case": case, "method": method, "ratio": ratio, **values}


def test_verdicts_are_words_with_what_to_do():
    rows = [row("L1s5", OURS, 0.1, recall=0.9, rel_l2=0.05), row("L1s5", "sol:topk", 0.2, rel_l2=0.1),
            row("L2s5", OURS, 0.1, recall=0.6, rel_l2=0.05), row("L2s5", "sol:topk", 0.2, rel_l2=0.1),
            row("L3s5", OURS, 0.1, recall=0.9, rel_l2=0.2), row("L3s5", "sol:topk", 0.2, rel_l2=0.1),
            row("L4s5", OURS, 0.1, recall=0.9, rel_l2=0.05),
            row("L5s5", OURS, 0.2, recall=0.9, rel_l2=0.05),
            row("L6s5", OURS, 0.1, error="RuntimeError: boom"),
            row("L7s5", OURS, 0.1, recall=None, rel_l2=None)]
    lines = verdicts(rows, "comfy-kitchen 0.2.31 has no sol_attn (it came in 0.2.40)")
    assert len(lines) == 7
    assert lines[0].startswith("L1s5: pass: the node's defaults at topk_ratio 0.1 keep 90.0% of the attention mass "
                               "(bound: at least 85%), rel L2 0.050 (comfy-kitchen's sol_attn at top-k 0.2: 0.100")
    for line in lines[1:3]:
        assert ": worse than the acceptance bound: " in line and "raise topk_ratio" in line and "dense_layers" in line
    assert "keep 60.0%" in lines[1] and "rel L2 0.200 (comfy-kitchen's sol_attn at top-k 0.2: 0.100" in lines[2]
    assert lines[3].startswith("L4s5: pass on recall, error comparison incomplete: ")
    assert "comfy-kitchen 0.2.31 has no sol_attn (it came in 0.2.40)" in lines[3]
    assert lines[4].startswith("L5s5: incomplete: ") and "not asked for" in lines[4] and "0.1 in --ratios" in lines[4]
    assert lines[5].startswith("L6s5: incomplete: ") and "it failed: RuntimeError: boom" in lines[5]
    assert lines[6].startswith("L7s5: incomplete capture: ") and "capture a step" in lines[6]
    assert not any(word in " ".join(lines) for word in ("PASS", "FAIL", "INCOMPLETE"))


def test_evaluate_prints_verdicts_on_a_real_capture(tmp_path):
    layout = SequenceLayout.from_segments([(0, 16, "text"), (16, 16 + 4 * 8 * 12, "video", (4, 8, 12))])
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "capture.safetensors"
    save_capture(str(path), [{"layer": 3, "step": 5, **{n: torch.randn(1, 1, layout.total, 64, generator=g)
                                                         for n in "qkv"}}], layout)
    done = subprocess.run([sys.executable, str(REPO / "install.py"), "evaluate", str(path), "--ratios", "0.1",
                           "--methods", f"dense,{OURS},sol:topk", "--device", "cpu", "--rows", "16"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    verdict = done.stdout.split("Verdicts (")[1].splitlines()[1]
    assert verdict.startswith("L3s5: worse than the acceptance bound: ")  # random q/k: attention is spread out
    assert "Traceback" not in done.stdout + done.stderr


def test_comfy_kitchen_version_is_read_from_its_metadata():
    try:
        installed = importlib.metadata.version("comfy-kitchen")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("comfy-kitchen is not installed")
    assert methods.kitchen_version() == installed
    reason = methods.sol_unavailable_reason()
    assert reason is None or reason.startswith(f"comfy-kitchen {installed} ")
    assert "unknown version" not in (reason or "")
