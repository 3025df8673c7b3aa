"""The end-to-end benchmark's bookkeeping (CPU), and one tiny run in real ComfyUI when COMFYUI_PATH is set."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import comfyui_stubs
from comfyui_harness import CKPT, COMFYUI, comfy, needs_comfyui  # noqa: F401 (comfy is a fixture)

from adaptive_sparse_attention.bench import e2e
from adaptive_sparse_attention.nodes.widgets import SPARSE_WIDGETS, config_from_widgets



def test_graph_puts_our_node_between_loader_and_timer():
    widgets = e2e.node_widgets(e2e.SCALES["h3"], topk_ratio=0.1)
    assert config_from_widgets(widgets).topk_ratio == 0.1
    assert set(widgets) == {w.name for w in SPARSE_WIDGETS}
    ours = e2e.graph("m.safetensors", e2e.SCALES["h3"], 243, 19, 3.0, widgets, "a")
    plain = e2e.graph("m.safetensors", e2e.SCALES["h3"], 243, 19, 3.0, None, "b")
    assert ours["2"]["class_type"] == "AdaptiveSparseAttentionH3"
    assert ours["3"]["inputs"]["model"] == ["2", 0]
    assert "2" not in plain
    assert plain["3"]["inputs"]["model"] == ["1", 0]
    assert ours["7"]["inputs"]["cfg"] == 3.0
    assert ours["6"]["inputs"]["length"] == 243
    assert "9" not in ours
    assert ours["3"]["inputs"]["around"] == "diffusion_model"


def test_compiled_graph_puts_torch_compile_after_our_node():
    widgets = e2e.node_widgets(e2e.SCALES["h3"])
    ours = e2e.graph("m.safetensors", e2e.SCALES["h3"], 243, 19, 3.0, widgets, "a", "inductor")
    plain = e2e.graph("m.safetensors", e2e.SCALES["h3"], 243, 19, 3.0, None, "b", "inductor")
    assert ours["9"] == {"class_type": "TorchCompileModel", "inputs": {"model": ["2", 0], "backend": "inductor"}}
    assert plain["9"]["inputs"]["model"] == ["1", 0]
    for prompt in (ours, plain):  # the timer wraps apply_model, outside the compiled diffusion model
        assert prompt["3"]["inputs"]["model"] == ["9", 0]
        assert prompt["3"]["inputs"]["around"] == "apply_model"


def test_summary_splits_dense_first_and_steady_calls():
    calls = [900.0, 880.0, 300.0, 200.0, 100.0, 110.0, 105.0]
    reference = torch.ones(8)
    line = ("adaptive sparse attention: steps 1 dense / 3 sparse; blocks 4 dense / 12 sparse; mean density 0.250 "
            "in sparse blocks (0.4 over all blocks); sparse attention time 1.50 s; precision bf16; plans reused 7, "
            "built 5 (1 rebuilds)")
    row = e2e.summarise("ours", calls, 4.0, 2.5, 2, reference * 1.01, reference,
                        [line + "; measured error 0.071 (worst block 3: 0.134)",
                         "adaptive sparse attention: kernels ready in 3.20 s (2 compiled, 24 loaded from Triton's cache)",
                         "adaptive sparse attention: kernels ready in 0.10 s (0 compiled, 26 loaded from Triton's cache)"])
    assert (row["dense_call_ms"], row["first_sparse_ms"], row["steady_sparse_ms"]) == (900.0, 300.0, 105.0)
    assert row["rel_l2"] == pytest.approx(0.01)
    assert row["prepare_s"] == pytest.approx(3.3) and row["compiled"] == 2  # two layouts prepared
    assert (row["measured_error"], row["worst_block_error"]) == (0.071, 0.134)
    assert (row["dense_blocks"], row["sparse_blocks"], row["density"], row["attention_s"]) == (4, 12, 0.25, 1.5)
    assert (row["plans_reused"], row["plans_built"], row["plan_rebuilds"], row["plans_past_budget"]) == (7, 5, 1, 0)
    past = e2e.summarise("ours", calls, 4.0, 2.5, 2, reference, reference,
                         [line.replace("(1 rebuilds)", "(1 rebuilds, 3 past the plans' memory budget)")])
    assert (past["plans_reused"], past["plan_rebuilds"], past["plans_past_budget"]) == (7, 1, 3)
    plain = e2e.summarise("comfyui", calls, 5.0, None, None, reference, None, [])
    assert "first_sparse_ms" not in plain
    assert plain["dense_call_ms"] == plain["median_call_ms"] == 200.0
    assert "report_saved_s" not in row  # nothing timed: no saved seconds
    saved = e2e.summarise("ours", calls, 4.0, 2.5, 2, reference, reference,
                          [line.replace("; precision bf16", "; precision bf16; attention saved 0.75 s against SDPA "
                                                            "cuDNN, ComfyUI's attention x.attention_pytorch")])
    assert (saved["report_saved_s"], saved["report_baseline"]) == (
        0.75, "SDPA cuDNN, ComfyUI's attention x.attention_pytorch")
    check = e2e.saving_markdown({"runs": [dict(plain, clip="10s"), dict(saved, clip="10s", measured_saved_s=1.0),
                                          dict(saved, run="ours-cold", clip="10s")]})
    assert check.splitlines()[2:] == [
        "| ours | 10s | 0.75 | SDPA cuDNN, ComfyUI's attention x.attention_pytorch | 1.00 | 0.75 |",
        "| ours-cold | 10s | 0.75 | SDPA cuDNN, ComfyUI's attention x.attention_pytorch | - | - |"]
    table = e2e.markdown({"blocks": 1, "runs": [dict(plain, clip="10s", frames=39), dict(row, clip="10s", frames=39)]})
    assert "| ours | 10s (39 frames) | 4.0 | 1.25x |" in table
    assert "| 0.250 | 0.071 | 0.0100 | 3.30 (2) |" in table


def test_compile_only_needs_a_compile_backend(tmp_path: Path):
    with pytest.raises(ValueError, match="compile_only needs a compile backend"):
        e2e.run_benchmark("/nowhere", tmp_path, "tiny", 1, 2, 3.0, ["10s"], compile_only=True)


def test_unknown_clip_is_named(tmp_path: Path):
    with pytest.raises(ValueError, match=r"clips \['30s'\] are not clips of scale 'tiny'; allowed: 5s, 10s"):
        e2e.run_benchmark("/nowhere", tmp_path, "tiny", 1, 2, 3.0, ["10s", "30s"])


def test_launch_modes_set_comfyuis_flags_and_refuse_a_missing_package(monkeypatch):
    from types import SimpleNamespace

    args = SimpleNamespace(use_sage_attention=False, use_ck_attention=False)
    e2e.set_launch(args, "default")
    assert args == SimpleNamespace(use_sage_attention=False, use_ck_attention=False)
    with pytest.raises(ValueError, match=r"e2e --launch fast: launch='fast' is not allowed: expected one of default, "
                                         r"ck, sage"):
        e2e.set_launch(args, "fast")
    monkeypatch.setattr(e2e.importlib.util, "find_spec", lambda name: None)  # neither package installed
    with pytest.raises(ValueError, match=r"--use-sage-attention needs the sageattention package: pip install "
                                         r"sageattention==1\.0\.6"):
        e2e.set_launch(args, "sage")
    with pytest.raises(ValueError, match=r"--use-ck-attention needs the comfy-kitchen package"):
        e2e.set_launch(args, "ck")
    assert args == SimpleNamespace(use_sage_attention=False, use_ck_attention=False)
    monkeypatch.setattr(e2e, "launch_unavailable_reason", lambda launch: None)  # as on a GPU machine with both
    monkeypatch.delitem(sys.modules, "comfy.ldm.modules.attention", raising=False)
    e2e.set_launch(args, "sage")
    assert args.use_sage_attention
    assert not args.use_ck_attention
    monkeypatch.setitem(sys.modules, "comfy.ldm.modules.attention", object())  # imported already: too late
    with pytest.raises(RuntimeError, match="imported already"):
        e2e.set_launch(SimpleNamespace(), "ck")


def test_a_launch_whose_package_is_missing_is_refused_before_comfyui_loads(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(e2e.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="e2e --launch sage: --use-sage-attention needs the sageattention package"):
        e2e.run_benchmark("/nowhere", tmp_path, "tiny", 1, 2, 3.0, ["10s"], launch="sage")
    assert not (tmp_path / "custom_nodes").exists()


def test_cli_takes_launch_and_precision(capsys):
    from adaptive_sparse_attention.bench.cli import build_parser

    args = build_parser().parse_args(["e2e", "--launch", "ck", "--precision", "8-bit"])
    assert (args.launch, args.precision) == ("ck", "8-bit")
    args = build_parser().parse_args(["e2e"])
    assert (args.launch, args.precision) == ("default", "auto")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["e2e", "--launch", "xformers"])
    assert "invalid choice: 'xformers'" in capsys.readouterr().err


def test_set_gives_widgets_to_every_run_of_ours_and_refuses_what_the_node_has_not(tmp_path: Path, capsys):
    from adaptive_sparse_attention.bench.cli import build_parser

    args = build_parser().parse_args(["e2e", "--set", "plan_reuse=on", "--set", "topk_ratio=0.1", "--set",
                                      "strict=true", "--set", "dense_layers=0,1"])
    assert dict(args.set) == {"plan_reuse": "on", "topk_ratio": 0.1, "strict": True, "dense_layers": "0,1"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["e2e", "--set", "plan_reuse"])
    assert "expected NAME=VALUE" in capsys.readouterr().err
    scale = e2e.dataclasses.replace(e2e.SCALES["tiny"], widgets={**e2e.SCALES["tiny"].widgets, "plan_reuse": "on"})
    assert config_from_widgets(e2e.node_widgets(scale)).plan_reuse == "on"
    assert config_from_widgets(e2e.node_widgets(scale, warmup_mode="ramp")).plan_reuse == "on"
    with pytest.raises(ValueError, match=r"widgets \['plan_reuses'\] are not widgets of the sparse node; allowed: "):
        e2e.run_benchmark("/nowhere", tmp_path, "tiny", 1, 2, 3.0, ["10s"], widgets={"plan_reuses": "on"})
    with pytest.raises(ValueError, match="plan_reuse"):
        e2e.run_benchmark("/nowhere", tmp_path, "tiny", 1, 2, 3.0, ["10s"], widgets={"plan_reuse": "yes"})
    assert not (tmp_path / "custom_nodes").exists()  # refused before ComfyUI loads


def test_precision_reaches_every_run_of_ours():
    scale = e2e.dataclasses.replace(e2e.SCALES["tiny"], widgets={**e2e.SCALES["tiny"].widgets, "precision": "8-bit"})
    assert config_from_widgets(e2e.node_widgets(scale, topk_ratio=0.1)).precision == "8-bit"
    assert e2e.node_widgets(e2e.SCALES["tiny"])["precision"] == "auto"


@needs_comfyui
def test_tiny_run_in_real_comfyui(tmp_path: Path):
    out = tmp_path / "e2e.json"
    (tmp_path / "stubs").mkdir()
    (tmp_path / "stubs" / "sitecustomize.py").write_text(comfyui_stubs.STUBS)  # ComfyUI imports on this CPU
    path = os.pathsep.join(p for p in (str(tmp_path / "stubs"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-m", "adaptive_sparse_attention", "e2e", "--comfyui", COMFYUI,
                           "--scale", "tiny", "--blocks", "1", "--steps", "2", "--clips", "10s",
                           "--work", str(tmp_path), "--out", str(out), "--compile", "eager"], capture_output=True,
                          text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {(r["run"], r["clip"]): r for r in json.loads(out.read_text())["runs"]}
    assert runs[("ours", "10s")]["calls"] == 4
    assert runs[("ours-all-dense", "10s")]["density"] == 1.0
    for name in ("ours-reuse", "ours-ramp", "ours-ramp-reuse"):  # step 0 dense (ramp: sigma_max), step 1 sparse
        assert runs[(name, "10s")]["calls"] == 4 and runs[(name, "10s")]["sparse_blocks"] == 2, name
    assert 0 < runs[("ours", "10s")]["rel_l2"] < 0.1
    assert runs[("ours", "10s")]["sparse_blocks"] == 2
    assert "| comfyui | 10s (39 frames)" in proc.stdout
    assert "ComfyUI launched as default (its attention: " in proc.stdout
    assert json.loads(out.read_text())["launch"] == "default"
    # TorchCompileModel after our node: the same latent, every sparse block counted and measured
    for name in ("ours-compiled", "ours-compiled-warm"):
        row = runs[(name, "10s")]
        assert row["calls"] == 4
        assert row["sparse_blocks"] == 2
        assert row["density"] == runs[("ours", "10s")]["density"]
        assert row["rel_l2"] == pytest.approx(runs[("ours", "10s")]["rel_l2"], rel=1e-3)
    assert runs[("comfyui-compiled-warm", "10s")]["calls"] == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals are those of a machine without a GPU")
def test_checkpoint_formats_the_device_cannot_multiply_in_are_refused(tmp_path: Path, capsys):
    from adaptive_sparse_attention.bench.cli import build_parser

    for weights, need in (("fp8", "fp8 matmuls need sm89 or newer"), ("nvfp4", "nvfp4 matmuls need sm100 or newer")):
        with pytest.raises(ValueError, match=f"e2e: --weights {weights}: {need}; the CPU has none"):
            e2e.run_benchmark("/nowhere", tmp_path, "tiny", 1, 2, 3.0, ["10s"], weights=weights)
    (tmp_path / "main.py").write_text("")  # looks like a ComfyUI checkout: the refusal comes before loading it
    args = build_parser().parse_args(["e2e", "--comfyui", str(tmp_path), "--weights", "nvfp4"])
    assert args.func(args) == 2
    assert "e2e: --weights nvfp4: nvfp4 matmuls need sm100 or newer" in capsys.readouterr().err
    assert build_parser().parse_args(["e2e"]).weights is None  # the preset's
    assert e2e.resolve_preset("ksampler-19-cfg3", None, None, None, None, None)[3] == "bf16"
    assert e2e.resolve_preset("turbo-8", None, None, None, None, None)[3] == "int8_convrot"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["e2e", "--weights", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_qkv_table_puts_ours_beside_comfyuis():
    t = {"rows": 73_000, "format": "int8_tensorwise", "comfyui_qkv_proj_ms": 10.0, "ours_projection_ms": 10.4,
         "projection_vs_comfyui": 1.04, "comfyui_production_ms": 13.0, "ours_producer_ms": 14.0,
         "producer_vs_comfyui": 14.0 / 13.0, "epilogue": "triton"}
    assert ("| 10s | 73,000 | int8_tensorwise | 10.00 | 10.40 | 1.040x | 13.00 | 14.00 (triton) | 1.077x |"
            in e2e.qkv_markdown({"qkv": {"10s": t}}))


def test_reused_plan_ms_times_planning_on_a_kept_plan():
    """The op table's "plan reused": every timed call reuses the kept plan (the torch reference on the CPU)."""
    from adaptive_sparse_attention import SequenceLayout, SparseConfig

    layout = SequenceLayout.from_segments([(0, 37, "text"), (37, 37 + 3 * 8 * 12, "video", (3, 8, 12))])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, layout.total, 64, generator=g) for _ in range(3))
    assert e2e.reused_plan_ms(q, k, v, layout, SparseConfig(kernel="torch"), reps=3) > 0


def test_split_table_shows_the_reused_plan_beside_the_fresh_one():
    result = {"blocks": 4, "op": {"10s": {"op_ms": 106.4, "plan_ms": 14.9, "kernel_ms": 93.3, "plan_reused_ms": 3.2,
                                           "dense_flash_ms": 435.0, "dense_cudnn_ms": 271.0}},
              "runs": [{"run": "ours", "clip": "10s", "steady_sparse_ms": 767.0, "attention_s": 3.29, "sparse_blocks": 24},
                       {"run": "comfyui", "clip": "10s", "median_call_ms": 2066.0}]}
    assert "| 106.4 (14.9 + 93.3) | 3.2 | 81.5 |" in e2e.split_markdown(result)


@needs_comfyui
def test_tiny_int8_convrot_run_in_real_comfyui(tmp_path: Path):
    out = tmp_path / "e2e.json"
    (tmp_path / "stubs").mkdir()
    (tmp_path / "stubs" / "sitecustomize.py").write_text(comfyui_stubs.STUBS)
    path = os.pathsep.join(p for p in (str(tmp_path / "stubs"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-m", "adaptive_sparse_attention", "e2e", "--comfyui", COMFYUI,
                           "--scale", "tiny", "--blocks", "1", "--steps", "2", "--clips", "10s", "--runs", "ours",
                           "--weights", "int8_convrot", "--work", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["weights"] == "int8_convrot"
    assert [r["run"] for r in result["runs"]] == ["comfyui", "ours"]
    assert 0 < result["runs"][1]["rel_l2"] < 0.1
    qkv = result["qkv"]["10s"]
    assert qkv["format"] == "int8_tensorwise"
    assert qkv["rows"] > 0
    assert qkv["comfyui_qkv_proj_ms"] > 0 and qkv["comfyui_production_ms"] > 0 and qkv["ours_producer_ms"] > 0
    assert qkv["epilogue"] == "torch"  # a CPU run: the torch reference
    assert "| 10s |" in proc.stdout
    assert "int8_tensorwise" in proc.stdout


def test_two_copies_of_a_model_larger_than_half_the_gpu_are_left_out(monkeypatch):
    from types import SimpleNamespace

    model = SimpleNamespace(model_size=lambda: 44 * 2 ** 30)  # H3's 50 blocks, int8_convrot (43.8 GiB)
    assert e2e.two_copies_unfit(model, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2 ** 30))
    assert e2e.two_copies_unfit(model, torch.device("cuda")) == (
        "its deep clone is a second copy of the 44.0 GiB model; two do not fit the device's 80 GiB")
    assert e2e.two_copies_unfit(SimpleNamespace(model_size=lambda: 20 * 2 ** 30), torch.device("cuda")) is None


@needs_comfyui
def test_qkv_timing_uses_the_loaded_model_and_loads_no_second_copy(comfy):
    """The QKV table times the model the graphs loaded (the timer's input MODEL), not a second loader's copy."""
    import comfy.model_management as mm

    from adaptive_sparse_attention.bench import e2e_nodes

    _, nodes = comfy
    patcher = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    timed = e2e_nodes.ASABenchTimer().wrap(patcher, "a")[0]
    assert e2e_nodes.STATE["patcher"] is patcher and timed is not patcher
    mm.load_models_gpu([patcher])

    def loaded() -> set[int]:
        return {id(m.model.model) for m in mm.current_loaded_models if m.model is not None}

    before = loaded()
    assert id(patcher.model) in before
    t = e2e.qkv_timing(e2e_nodes.STATE["patcher"], e2e.SCALES["tiny"], "10s", torch.device("cpu"), reps=1, rounds=1)
    assert t["rows"] > 0 and t["comfyui_qkv_proj_ms"] > 0
    assert loaded() == before  # no model loaded beside it
    e2e_nodes.STATE["patcher"] = None
