"""CLI smoke tests at reduced sizes (the real presets run in BENCHMARKS.md), method specs, the
FlexAttention block mask (built on the CPU; only running Flex needs CUDA), the GPU timing
subcommands (their options, without Triton too) and the import graph of bench/ (no cycles)."""
import ast
import dataclasses
import graphlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaptive_sparse_attention import SequenceLayout, SparseConfig
from adaptive_sparse_attention.bench import scenes
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.bench import methods
from adaptive_sparse_attention.bench.cli import main
from adaptive_sparse_attention.bench.report import acceptance

TINY = dataclasses.replace(scenes.SIZES["cpu-small"], text=16, audio=24, grid=(4, 8, 12), heads=1, head_dim=128)


@pytest.fixture
def tiny_presets(monkeypatch):
    monkeypatch.setitem(scenes.SIZES, "demo", dataclasses.replace(TINY, head_dim=64))
    monkeypatch.setitem(scenes.SIZES, "cpu-small", TINY)


def test_demo_prints_a_table(tiny_presets, capsys):
    assert main(["demo", "--device", "cpu", "--ratios", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "| pan | dense |" in out
    for tail in ("reweight", "mean", "none"):
        assert f":{tail}:query | 0.200 |" in out


def test_bench_writes_table_json_and_plots(tiny_presets, tmp_path, capsys):
    specs = "ours:cube:reweight:query,ours:cube:none:*@0.2,sol:topk"
    assert main(["bench", "--preset", "cpu-small", "--methods", specs, "--ratios", "0.1,0.2", "--scenes", "pan",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cpu-small.json").read_text())
    got = {(r["method"], r["ratio"]) for r in result["rows"]}
    assert ("dense", None) in got
    assert ("ours:cube:none:block", 0.2) in got
    assert ("ours:cube:reweight:query", 0.1) in got
    assert ("ours:cube:none:query", 0.1) not in got  # its own ratio list
    assert all(r["speedup"] > 0 and r["ms"] > 0 for r in result["rows"])
    ours = [r for r in result["rows"] if r["method"].startswith("ours")]
    assert all(0 < r["recall"] <= 1 and r["ctx_rel_l2"] < 1e-5 for r in ours)
    assert ("sol:topk", 0.1) in got or methods.unavailable_reason("sol:topk", torch.device("cpu"), 128)
    md = (tmp_path / "cpu-small.md").read_text()
    assert "| pan | ours:cube:reweight:query | 0.100 |" in md
    assert "command:" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "cpu-small_pareto.png").stat().st_size > 0
    assert (tmp_path / "cpu-small_recall.png").exists()


def test_method_specs_expand_and_reject():
    assert methods.expand_methods(["ours:cube:*:query"]) == [f"ours:cube:{t}:query" for t in ("reweight", "mean", "none", "coarse")]
    assert methods.expand_methods(["ours:*:none:block@0.1/0.3"]) == ["ours:reblock:none:block@0.1/0.3", "ours:cube:none:block@0.1/0.3"]
    assert methods.split_spec("flex:cube@0.1/0.3") == ("flex:cube", [0.1, 0.3])
    assert methods.expand_methods(["ours:reblock:reweight:query:*@0.2"]) == [
        "ours:reblock:reweight:query:b64@0.2", "ours:reblock:reweight:query:b128@0.2"]
    assert methods.ours_config("ours:cube:none:block:b128", 0.2, "torch").block_size == 128
    assert methods.ours_config("ours:cube:none:block", 0.2, "torch").block_size == 64
    for bad in ("ours:cube:reweight", "ours:hex:none:query", "ours:cube:none:query:b96", "sol:tau=x", "flash",
                "dense@x", "sol:topk@2"):
        with pytest.raises(ValueError, match="method"):
            methods.expand_methods([bad])


def test_dense_kernel_rows_are_specs_that_say_why_they_cannot_run_here(tiny_presets, tmp_path, capsys):
    assert methods.expand_methods(["dense:fa4", "dense:ck-int8", "dense:sage"]) == ["dense:fa4", "dense:ck-int8",
                                                                                      "dense:sage"]
    with pytest.raises(ValueError, match=r"dense:<fa4\|ck-int8\|sage>"):
        methods.expand_methods(["dense:xformers"])
    cpu = torch.device("cpu")
    assert methods.unavailable_reason("dense:fa4", cpu, 128) == "needs a CUDA GPU"
    assert methods.unavailable_reason("dense:sage", cpu, 128) == ("SageAttention sageattn (ComfyUI --use-sage-attention) "
                                                                   "needs a CUDA GPU")
    assert "needs a CUDA GPU" in methods.unavailable_reason("dense:ck-int8", cpu, 128)
    assert main(["bench", "--preset", "cpu-small", "--methods", "dense:fa4,dense:sage", "--scenes", "pan",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "cpu-small.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["dense"]  # skipped, each said once with its reason
    err = capsys.readouterr().err
    assert "pan dense:fa4: skipped: needs a CUDA GPU" in err
    assert "pan dense:sage: skipped:" in err


def test_acceptance_lines():
    rows = [{"case": "pan", "method": methods.DEFAULT_METHOD, "ratio": 0.1, "rel_l2": 0.05, "recall": 0.9},
            {"case": "pan", "method": "sol:topk", "ratio": 0.2, "rel_l2": 0.1},
            {"case": "cuts", "method": methods.DEFAULT_METHOD, "ratio": 0.1, "rel_l2": 0.2, "recall": 0.8},
            {"case": "cuts", "method": "sol:topk", "ratio": 0.2, "rel_l2": 0.1}]
    lines = [line for line in acceptance(rows) if methods.DEFAULT_METHOD in line]
    assert "PASS" in lines[0]
    assert "FAIL" in lines[1]
    assert "L2 worse" in lines[1]
    assert "recall < 0.85" in lines[1]


def test_flex_block_mask_matches_the_plan():
    pytest.importorskip("torch.nn.attention.flex_attention")
    layout = SequenceLayout.from_segments([(0, 70, "text"), (70, 70 + 5 * 6 * 7, "video", (5, 6, 7))])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, layout.total, 32, generator=g) for _ in range(3))
    kp = build_plan(q, k, v, layout, SparseConfig(topk_ratio=0.3, tiling="cube", tail="none"))
    mask = methods.flex_block_mask(kp)
    full = torch.zeros_like(kp.allowed_mask())
    partial = torch.zeros_like(full)
    for table, dest in (((mask.full_kv_num_blocks, mask.full_kv_indices), full), ((mask.kv_num_blocks, mask.kv_indices), partial)):
        num, idx = table
        for h in range(2):
            for i in range(kp.num_blocks):
                dest[0, h, i, idx[0, h, i, : num[0, h, i]].long()] = True
    assert torch.equal(full | partial, kp.allowed_mask().expand_as(full))
    whole = kp.block_len == kp.block_size
    assert not (full & ~whole).any()
    assert not (partial & whole).any()


def test_time_budget_records_runs_not_made(tiny_presets):
    from adaptive_sparse_attention.bench.runner import run_preset

    result = run_preset("cpu-small", ["ours:cube:none:query"], [0.2], torch.device("cpu"), scenes=["pan"], deadline=0.0)
    assert [r["error"] for r in result["rows"]] == ["not run: time budget spent"] * 2


def test_an_h3_preset_runs_on_the_cpu_only_with_fewer_heads(monkeypatch):
    """`--heads` runs an H3-size preset's geometry with a few heads on the CPU; without it the preset needs a GPU."""
    from adaptive_sparse_attention.bench import runner

    monkeypatch.setitem(scenes.SIZES, "h3-5s", dataclasses.replace(TINY, heads=56))  # the preset's, small enough here
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="needs a CUDA GPU.*--heads 4"):
        runner.run_preset("h3-5s", ["dense"], [0.2], cpu, "torch")
    with pytest.raises(ValueError, match="--heads 9 is not allowed: expected 1 to 8"):
        runner.run_preset("h3-5s", ["dense"], [0.2], cpu, "torch", heads=9)
    result = runner.run_preset("h3-5s", ["dense", "ours:cube:none:query:b128"], [0.2], cpu, "torch", scenes=["pan"],
                               heads=2)
    assert result["size"]["heads"] == 2 and result["size"]["tokens"] == TINY.total
    assert [r["method"] for r in result["rows"]] == ["dense", "ours:cube:none:query:b128"]
    assert all("error" not in r for r in result["rows"])


def test_steps_runs_a_size_with_fewer_heads(capsys):
    """`steps --heads` runs a size's geometry with a few heads (its tables say so); other counts are refused."""
    with pytest.raises(ValueError, match="steps: --heads 9 is not allowed: expected 1 to 8"):
        main(["steps", "--size", "demo", "--heads", "9"])
    code = main(["steps", "--size", "demo", "--heads", "1", "--scenes", "pan", "--ratios", "0.2", "--steps", "4",
                 "--warmup-ratio", "0.4", "--kernel", "torch", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code in (0, 1) and out.startswith("demo with 1 head, 4 steps"), out
    assert "| pan | 0.2 | sigma | 0.08 | 2 |" in out, out


# Each GPU tool's subcommand and the options it must keep (scripts and BENCHMARKS.md commands use them).
GPU_TOOLS = {
    "planner-timing": ["--out", "--shape", "--ratio"],
    "reblock-timing": ["--out", "--video", "--heads", "--profile"],
    "tiling-ceiling": ["--preset", "--scene", "--part", "--out"],
    "ulysses-timing": ["--out", "--video", "--heads", "--ratio", "--tiling"],
    "routing-quality": ["--size", "--scenes", "--ratios", "--tiling", "--rows", "--device", "--seed", "--out"],
    "steps": ["--size", "--heads", "--scenes", "--ratios", "--steps", "--shift", "--warmup-ratio", "--tiling", "--device", "--out"],
}


@pytest.mark.parametrize("command", GPU_TOOLS)
def test_gpu_tool_help_lists_its_options(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"adaptive_sparse_attention {command}" in out
    assert all(option in out for option in GPU_TOOLS[command]), out


def test_cli_needs_no_triton():
    """Every subcommand parses where Triton is not installed."""
    script = ("import sys; sys.modules['triton'] = None\n"
              "from adaptive_sparse_attention.bench.cli import build_parser\n"
              f"for command in {list(GPU_TOOLS)!r}: build_parser().parse_args([command])\n"
              "print('parsed')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "parsed", done.stderr[-2000:]


def import_graph(folder: Path) -> dict[str, set[str]]:
    """module -> modules of `folder` it imports, from relative imports anywhere in its code (lazy
    imports inside functions included)."""
    names = {p.stem for p in folder.glob("*.py")}
    graph = {}
    for name in names:
        deps = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:  # from .x import ..., from . import x
                targets = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                deps.update(t for t in targets if t in names)
        graph[name] = deps - {name}
    return graph


def test_bench_imports_form_no_cycle(tmp_path):
    bench = Path(__file__).resolve().parents[1] / "bench"
    graph = import_graph(bench)
    assert "scenes" in graph["planner_timing"]
    assert graph["cli"] >= {"long_clips", "planner_timing"}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle
    (tmp_path / "a.py").write_text("def f():\n    from .b import g\n")
    (tmp_path / "b.py").write_text("from . import a\n")
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(import_graph(tmp_path)).prepare()
