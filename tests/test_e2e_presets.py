"""The e2e benchmark's presets: the official H3 template's graphs, built from ComfyUI's own nodes.

CPU checks of the prompts and the LoRA file, and tiny runs in real ComfyUI (COMFYUI_PATH) that check
the graph really ran those nodes: the sampler's schedule and shift, the LoRA's weight patches, one
model call a step at cfg 1, the attention override of ModelAttentionBackend in both graphs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import comfyui_stubs
from comfyui_harness import COMFYUI, comfy, needs_comfyui  # noqa: F401 (comfy is a fixture)

from adaptive_sparse_attention.bench import e2e, e2e_graphs

TEMPLATE_NODES = {"SamplerCustomAdvanced", "BasicGuider", "KSamplerSelect", "BasicScheduler", "RandomNoise"}


def prompt(preset: str, widgets: dict | None, **kw) -> dict:
    p = e2e_graphs.PRESETS[preset]
    return e2e_graphs.graph("m.safetensors", e2e.SCALES["h3"], 243, p.steps, p.cfg, widgets, "a", preset=p, **kw)


def test_template_presets_build_the_t2v_templates_sampler():
    widgets = e2e.node_widgets(e2e.SCALES["h3"])
    for name, steps, lora in (("t2v-20", 20, False), ("turbo-8", 8, True), ("turbo-4", 4, True)):
        ours, plain = prompt(name, widgets), prompt(name, None)
        types = {n["class_type"] for n in ours.values()}
        assert TEMPLATE_NODES <= types
        assert "KSampler" not in types
        assert ours["14"]["inputs"] == {"sampler_name": "res_multistep"}
        assert ours["15"]["inputs"] == {"model": ["3", 0], "scheduler": "simple", "steps": steps, "denoise": 1.0}
        assert ours["16"]["inputs"] == {"model": ["3", 0], "conditioning": ["4", 0]}  # no negative: cfg 1
        assert ours["7"]["inputs"]["guider"] == ["16", 0] and ours["7"]["inputs"]["sigmas"] == ["15", 0]
        assert ("10" in ours) == lora == ("10" in plain)
        if lora:  # loader -> LoRA -> our node
            assert ours["10"] == {"class_type": "LoraLoaderModelOnly", "inputs": {
                "model": ["1", 0], "lora_name": e2e_graphs.LORA_NAME, "strength_model": 1.0}}
            assert ours["2"]["inputs"]["model"] == ["10", 0]
            assert plain["3"]["inputs"]["model"] == ["10", 0]
        assert {k: v for k, v in plain.items() if k != "8"} == {
            k: v for k, v in ours.items() if k not in ("2", "3", "8")} | {"3": plain["3"]}
        assert e2e_graphs.PRESETS[name].weights == "int8_convrot"
        assert "11" not in ours and "12" not in ours  # the t2v template has neither node


def test_shift_and_attention_backend_go_into_both_graphs_in_the_fasth3_templates_order():
    widgets = e2e.node_widgets(e2e.SCALES["h3"])
    kw = dict(sigma_shift=(10.0, 3.0), attention_backend="comfy kitchen attention")
    ours, plain = prompt("turbo-8", widgets, **kw), prompt("turbo-8", None, **kw)
    for p in (ours, plain):
        assert p["11"] == {"class_type": "MiniMaxH3SigmaShift",
                           "inputs": {"model": ["10", 0], "shift_video": 10.0, "shift_audio": 3.0}}
        assert p["12"] == {"class_type": "ModelAttentionBackend",
                           "inputs": {"model": ["11", 0], "attention": "comfy kitchen attention"}}
    assert ours["2"]["inputs"]["model"] == ["12", 0]  # our node after the template's model patches
    assert plain["3"]["inputs"]["model"] == ["12", 0]


def test_the_old_run_stays_a_preset():
    p = e2e_graphs.PRESETS["ksampler-19-cfg3"]
    assert (p.steps, p.cfg, p.sampler, p.scheduler, p.custom, p.lora, p.weights) == (
        19, 3.0, "euler", "simple", False, False, "bf16")
    assert e2e_graphs.DEFAULT_PRESET == "ksampler-19-cfg3"
    g = prompt("ksampler-19-cfg3", None)
    assert g["7"]["class_type"] == "KSampler" and g["7"]["inputs"]["cfg"] == 3.0


def test_template_sizes_and_frames():
    assert [e2e_graphs.template_frames(s) for s in (2, 5, 10)] == [56, 124, 243]
    assert all((f - 5) % 17 == 0 for f in map(e2e_graphs.template_frames, (0.1, 1, 2.5, 7, 15)))
    h3 = e2e.SCALES["h3"]
    assert (h3.size("0.4mp-2s"), h3.frames["0.4mp-2s"]) == ((864, 480), 56)
    assert (h3.size("0.9mp-5s"), h3.frames["0.9mp-5s"]) == ((1280, 736), 124)
    assert (h3.size("10s"), h3.frames["10s"]) == ((1344, 768), 243)
    g = e2e_graphs.graph("m", h3, 56, 8, 1.0, None, "a", preset=e2e_graphs.PRESETS["turbo-8"], size=(864, 480))
    assert g["6"]["inputs"] == {"width": 864, "height": 480, "length": 56}


def test_preset_settings_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match=r"preset='sdxl' is not a preset; allowed: ksampler-19-cfg3, t2v-20"):
        e2e.resolve_preset("sdxl", None, None, None, None, None)
    with pytest.raises(ValueError, match="BasicGuider, which has no cfg"):
        e2e.resolve_preset("turbo-8", None, 3.0, None, None, None)
    with pytest.raises(ValueError, match=r"sigma_shift=\(10.0,\): expected \(video, audio\)"):
        e2e.resolve_preset("turbo-8", None, None, None, (10.0,), None)
    with pytest.raises(ValueError, match="attention_backend='sage'"):
        e2e.resolve_preset("turbo-8", None, None, None, None, "sage")
    assert e2e.resolve_preset("turbo-4", 2, None, "bf16", (10.0, 3.0), None)[1:] == (2, 1.0, "bf16")


def test_lora_file_is_what_comfyuis_lora_loader_reads(tmp_path: Path):
    import safetensors.torch

    n = e2e_graphs.write_lora(tmp_path / "l.safetensors", e2e.TINY, blocks=2, rank=16)
    sd = safetensors.torch.load_file(str(tmp_path / "l.safetensors"))
    assert n == 8 and len(sd) == 8 * 3
    up, down = sd["diffusion_model.blocks.1.attn.qkv_proj.lora_up.weight"], \
        sd["diffusion_model.blocks.1.attn.qkv_proj.lora_down.weight"]
    assert up.shape == (3 * 64, 16) and down.shape == (16, 64) and up.dtype == torch.bfloat16
    assert float(sd["diffusion_model.blocks.1.attn.qkv_proj.alpha"]) == 16.0
    assert sd["diffusion_model.blocks.0.mlp.fc2.lora_down.weight"].shape == (16, 128)
    delta = up.float() @ down.float()  # ~10% of the weights' spread (randn * in**-0.5)
    assert 0.05 < float(delta.std()) * 64 ** 0.5 < 0.2


@needs_comfyui
def test_comfyuis_resolution_selector_gives_the_template_sizes(comfy):  # noqa: F811
    from comfy_extras.nodes_resolution import ResolutionSelector

    for clip, (w, h, _) in e2e_graphs.TEMPLATE_SIZES.items():
        mp = float(clip.split("mp")[0])
        assert ResolutionSelector.execute("16:9 (Widescreen)", mp, 32).result == (w, h)


def run_e2e(tmp_path: Path, *args: str) -> tuple[dict, str]:
    (tmp_path / "stubs").mkdir()
    (tmp_path / "stubs" / "sitecustomize.py").write_text(comfyui_stubs.STUBS)
    path = os.pathsep.join(p for p in (str(tmp_path / "stubs"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=path)
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, "-m", "adaptive_sparse_attention", "e2e", "--comfyui", COMFYUI,
                           "--scale", "tiny", "--blocks", "1", "--runs", "ours", "--work", str(tmp_path),
                           "--out", str(out), *args], capture_output=True, text=True, env=env, timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def base_grid(schedule: list[float], shift: float) -> list[float]:
    """A flow schedule's sigmas on the unshifted grid (inverse of s*b / (1 + (s-1)*b))."""
    return [s / (shift + s * (1.0 - shift)) for s in schedule]


@needs_comfyui
def test_t2v_20_runs_the_templates_sampler_on_the_base_model(tmp_path: Path):
    result, stdout = run_e2e(tmp_path, "--preset", "t2v-20", "--steps", "3", "--clips", "0.4mp-2s")
    assert (result["preset"], result["sampler"], result["scheduler"], result["cfg"], result["weights"]) == (
        "t2v-20", "res_multistep", "simple", 1.0, "int8_convrot")
    assert result["lora_layers"] == 0
    runs = {r["run"]: r for r in result["runs"]}
    for name, r in runs.items():
        assert r["calls"] == 3  # cfg 1: one model call a step
        assert TEMPLATE_NODES <= set(r["graph"]) and "KSampler" not in r["graph"]
        assert r["model"]["patched_weights"] == 0 and not r["model"]["attention_override"]
        assert r["model"]["shift"] == 12.0  # no MiniMaxH3SigmaShift: the model's own
        assert len(r["schedule"]) == 4 and r["schedule"][-1] == 0.0
        assert r["size"] == [128, 96]
    assert "AdaptiveSparseAttentionH3" in runs["ours"]["graph"]
    assert runs["ours"]["sparse_blocks"] >= 1
    assert 0 < runs["ours"]["rel_l2"] < 0.1
    assert "preset t2v-20" in stdout and "the model's own sigma shift" in stdout


@needs_comfyui
def test_turbo_runs_the_lora_the_shift_and_the_attention_backend(tmp_path: Path):
    result, stdout = run_e2e(tmp_path, "--preset", "turbo-8", "--steps", "2", "--clips", "10s", "--sigma-shift",
                             "10,3", "--attention-backend", "pytorch attention")
    assert result["lora_layers"] == 4  # one block: qkv, out, fc1, fc2
    for r in result["runs"]:  # with and without our node
        assert r["calls"] == 2
        assert {"LoraLoaderModelOnly", "MiniMaxH3SigmaShift", "ModelAttentionBackend"} <= set(r["graph"])
        assert r["model"]["patched_weights"] == 4  # the LoRA's weight patches on the sampled model
        assert r["model"]["attention_override"]
        assert (r["model"]["shift"], r["model"]["audio_shift"], r["model"]["sigma_shift_video"]) == (10.0, 3.0, 10.0)
        # the schedule is shift 10's: back on the unshifted grid it is simple's evenly spaced one
        assert base_grid(r["schedule"], 10.0) == pytest.approx([1.0, 0.5, 0.0], abs=2e-3)
    assert 0 < result["runs"][1]["rel_l2"] < 0.1
    qkv = result["qkv"]["10s"]
    assert qkv["format"] == "int8_tensorwise + LoRA"  # ComfyUI's and our projection of the patched layer
    assert "| 10s | 905 | int8_tensorwise + LoRA |" in stdout
    assert "Turbo LoRA on 4 layers" in stdout and "MiniMaxH3SigmaShift 10/3" in stdout
