"""The frontier command: points read from e2e JSON (ratio from the run's name, the command's widgets or the
node's default; speed-up from the clip's comfyui run or a transcribed vs_comfyui), the PNG it draws, and
the transcribed full-depth file under docs/ giving the figures BENCHMARKS.md records."""
import json
from pathlib import Path

import pytest

from adaptive_sparse_attention.bench.cli import main
from adaptive_sparse_attention.bench.frontier import points, results_of

ROOT = Path(__file__).resolve().parent.parent


def e2e_result(widgets: dict, runs: list[dict], blocks: int = 4) -> dict:
    return {"preset": "turbo-8", "blocks": blocks, "device": "cpu", "widgets": widgets, "runs": runs}


RESULT = e2e_result({}, [
    {"run": "comfyui", "clip": "5s", "run_s": 10.0},
    {"run": "ours", "clip": "5s", "run_s": 5.0, "measured_error": 0.05},
    {"run": "ours-ratio-0.1", "clip": "5s", "run_s": 4.0, "measured_error": 0.08},
    {"run": "ours-speed", "clip": "5s", "run_s": 3.0},  # another warmup: no point of the frontier
    {"run": "ours-prepared", "clip": "5s", "run_s": 9.0},
    {"run": "comfyui", "clip": "10s", "run_s": 30.0},
    {"run": "ours", "clip": "10s", "run_s": 12.0},
])


def test_points_take_ratio_and_speed_up_from_the_runs():
    lines = points([RESULT, e2e_result({"topk_ratio": 0.3}, [{"run": "comfyui", "clip": "5s", "run_s": 10.0},
                                                             {"run": "ours", "clip": "5s", "run_s": 8.0}])])
    assert lines == {"5s, 4 blocks, turbo-8, cpu": [(0.1, 2.5, 0.08), (0.2, 2.0, 0.05), (0.3, 1.25, None)],
                     "10s, 4 blocks, turbo-8, cpu": [(0.2, 2.5, None)]}


def test_a_transcribed_speed_up_counts_and_a_run_with_nothing_to_compare_is_refused():
    lines = points([e2e_result({"topk_ratio": 0.05}, [{"run": "ours", "clip": "5s", "vs_comfyui": 2.0}], 50)])
    assert lines == {"5s, 50 blocks, turbo-8, cpu": [(0.05, 2.0, None)]}
    with pytest.raises(ValueError, match="run 'ours' of clip '5s' has no comfyui run"):
        points([e2e_result({}, [{"run": "ours", "clip": "5s", "run_s": 5.0}])])


def test_a_file_that_is_no_e2e_result_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="bad.json: result 0 has no list of runs"):
        results_of(bad)


def test_the_command_writes_a_png_with_both_panels(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    source = tmp_path / "e2e.json"
    source.write_text(json.dumps(RESULT))
    out = tmp_path / "frontier.png"
    assert main(["frontier", "--from", str(source), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "5s, 4 blocks, turbo-8, cpu: ratio 0.1 2.50x (error 0.08), ratio 0.2 2.00x (error 0.05)" in printed
    assert "ratio only" not in printed


def test_the_docs_file_holds_the_full_depth_runs_of_benchmarks():
    lines = points(results_of(ROOT / "docs" / "frontier-h100-2026-12-07.json"))
    assert lines == {"5s, 50 blocks, turbo-8, NVIDIA H100 80GB HBM3": [
        (0.05, 2.0, None), (0.1, 1.93, None), (0.2, 1.8, None), (0.3, 1.67, None)]}
    benchmarks = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    section = benchmarks.split("## End to end at full depth", 1)[1].split("\n## ", 1)[0]
    for figure in ("1.67x", "1.80x", "1.93x", "2.00x", "fc0811c", "2026-12-07", "docs/frontier.png"):
        assert figure in section, figure
