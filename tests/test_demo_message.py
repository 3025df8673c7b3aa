"""The demo on a CPU says that its times are the reference kernel's, not a speed claim, and a line under
its table explains every column."""
import dataclasses

from adaptive_sparse_attention.bench import scenes
from adaptive_sparse_attention.bench.cli import demo_timing_note, main
from adaptive_sparse_attention.bench.report import COLUMN_NOTES, HEADERS


def test_cpu_demo_explains_its_times(monkeypatch, capsys):
    small = dataclasses.replace(scenes.SIZES["cpu-small"], text=16, audio=24, grid=(4, 8, 12), heads=1, head_dim=64)
    monkeypatch.setitem(scenes.SIZES, "demo", small)
    assert main(["demo", "--device", "cpu", "--ratios", "0.2", "--kernel", "torch"]) == 0
    raw = capsys.readouterr().out
    out = " ".join(raw.split())  # the note is wrapped
    assert out.index("| pan | dense |") < out.index("pure-torch reference kernel")
    lines = raw.splitlines()
    table_end = max(i for i, line in enumerate(lines) if line.startswith("|"))
    for header in HEADERS:  # each column explained once, under the table
        (at,) = [i for i, line in enumerate(lines) if line.startswith(f"- {header}: ")]
        assert at > table_end
    assert "no speed claim" in out
    assert "Expected speed-up by clip length" in out  # a README section


def test_timing_note_names_the_backend_that_ran():
    torch_note, triton_note = (" ".join(demo_timing_note(b).split()) for b in ("torch", "triton"))
    assert "reference kernel" in torch_note
    assert "triton kernels" in triton_note
    assert "reference" not in triton_note


def test_every_column_has_one_note():
    assert [name for name, _ in COLUMN_NOTES] == list(HEADERS)
    notes = dict(COLUMN_NOTES)
    assert "softmax mass" in notes["log-mass err"]
    assert "natural log" in notes["log-mass err"]
