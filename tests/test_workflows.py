"""Bundled workflows: valid ComfyUI UI-format graphs whose node widgets match our schemas, with notes on the
canvas (what each part does, which model file goes in which folder) and the report node after the sampler."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.nodes.widgets import (CAPTURE_NODE_ID, CAPTURE_WIDGETS, REPORT_NODE_ID, REPORT_NODE_NAME,
                                                     SPARSE_NODE_ID, SPARSE_WIDGETS, Widget, capture_selection,
                                                     config_from_widgets)
from comfyui_harness import FRONTEND_ONLY

WORKFLOWS = sorted((Path(__file__).resolve().parent.parent / "workflows").glob("*.json"))
OURS = {SPARSE_NODE_ID: SPARSE_WIDGETS, CAPTURE_NODE_ID: CAPTURE_WIDGETS}
LOADER_FOLDERS = {"UNETLoader": "models/diffusion_models/", "CLIPLoader": "models/text_encoders/",
                  "VAELoader": "models/vae/"}
SAMPLERS = {"SamplerCustomAdvanced", "KSampler", "KSamplerAdvanced"}


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_the_four_scenarios_are_bundled():
    names = {p.stem for p in WORKFLOWS}
    assert {"h3_text_to_audio_video_sparse", "h3_keyframes_to_video_sparse", "h3_reference_to_video_joint_sparse",
            "h3_low_vram_sparse"} <= names


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_graph_is_consistent(path):
    wf = load(path)
    assert {"nodes", "links", "last_node_id", "last_link_id", "version"} <= set(wf)
    nodes = {n["id"]: n for n in wf["nodes"]}
    assert len(nodes) == len(wf["nodes"])
    assert max(nodes) <= wf["last_node_id"]
    assert all(lk[0] <= wf["last_link_id"] for lk in wf["links"])
    for link_id, src, src_slot, dst, dst_slot, kind in wf["links"]:
        out, inp = nodes[src]["outputs"][src_slot], nodes[dst]["inputs"][dst_slot]
        assert link_id in out["links"], f"{path.name}: link {link_id} is not wired both ways"
        assert inp["link"] == link_id, f"{path.name}: link {link_id} is not wired both ways"
        assert out["type"] == inp["type"] == kind, f"{path.name}: link {link_id} joins {out['type']} to {inp['type']}"
    linked = {lk[0] for lk in wf["links"]}
    for node in wf["nodes"]:
        assert all(i["link"] is None or i["link"] in linked for i in node.get("inputs", []))
        assert all(set(o.get("links") or []) <= linked for o in node.get("outputs", []))


def check_widgets(values: list, widgets: tuple[Widget, ...], where: str) -> dict:
    assert len(values) == len(widgets), f"{where}: {len(values)} widget values for {len(widgets)} widgets"
    for w, v in zip(widgets, values):
        assert w.accepts(v), f"{where}: {w.name}={v!r} is not valid"
    return {w.name: v for w, v in zip(widgets, values)}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_our_nodes_match_the_schema(path):
    wf = load(path)
    ours = [n for n in wf["nodes"] if n["type"] in OURS]
    assert any(n["type"] == SPARSE_NODE_ID for n in ours), f"{path.name} does not use {SPARSE_NODE_ID}"
    for node in ours:
        values = check_widgets(node["widgets_values"], OURS[node["type"]], f"{path.name} node {node['id']}")
        if node["type"] == SPARSE_NODE_ID:
            assert isinstance(config_from_widgets(values), SparseConfig)
            model_in = [i for i in node["inputs"] if i["name"] == "model"]
            assert model_in
            assert model_in[0]["type"] == "MODEL"
            assert model_in[0]["link"] is not None
        else:
            capture_selection(values["layers"], values["steps"])


def test_scenario_settings():
    by_name = {p.stem: load(p) for p in WORKFLOWS}

    def sparse_values(name):
        node = next(n for n in by_name[name]["nodes"] if n["type"] == SPARSE_NODE_ID)
        return dict(zip((w.name for w in SPARSE_WIDGETS), node["widgets_values"]))

    assert sparse_values("h3_reference_to_video_joint_sparse")["sparse_scope"] == "joint-video"
    chain = by_name["h3_low_vram_sparse"]
    nodes = {n["id"]: n for n in chain["nodes"]}
    # loader -> low-VRAM attention -> chunked feed-forward -> our node
    into = {dst: nodes[src]["type"] for _, src, _, dst, _, kind in chain["links"] if kind == "MODEL"}
    ours = next(n["id"] for n in chain["nodes"] if n["type"] == SPARSE_NODE_ID)
    ffn = next(n["id"] for n in chain["nodes"] if n["type"] == "MiniMaxChunkFeedForward")
    attn = next(n["id"] for n in chain["nodes"] if n["type"] == "MiniMaxLowVRAMAttention")
    assert (into[ours], into[ffn], into[attn]) == ("MiniMaxChunkFeedForward", "MiniMaxLowVRAMAttention", "UNETLoader")


def test_widget_spec_mirrors_sparse_config():
    """Every SparseConfig field is a widget, with SparseConfig's default; `kernel` (the reference by name) is the
    last, optional, so prompts saved before it run on auto."""
    defaults = SparseConfig()
    names = [w.name for w in SPARSE_WIDGETS]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(SparseConfig))
    assert names[-1] == "kernel" and SPARSE_WIDGETS[-1].optional and SPARSE_WIDGETS[-1].default == "auto"
    for w in SPARSE_WIDGETS:
        default = getattr(defaults, w.name)
        assert (",".join(map(str, default)) if w.name == "dense_layers" else default) == w.default
        assert w.tooltip
        assert w.accepts(w.default)
    assert [w.name for w in SPARSE_WIDGETS if not w.advanced] == ["topk_ratio", "warmup_mode", "sparse_scope",
                                                                  "tail_granularity", "precision"]
    with pytest.raises(ValueError, match="missing widget values"):
        config_from_widgets({"topk_ratio": 0.2})
    values = {w.name: w.default for w in SPARSE_WIDGETS}
    with pytest.raises(ValueError, match="topk_ratio"):
        config_from_widgets({**values, "topk_ratio": 0.0})
    with pytest.raises(ValueError, match="Capture H3 Attention.steps"):
        capture_selection("1", "")


def test_install_check_reports_and_requirements_leave_pins_alone():
    import subprocess
    import sys

    root = WORKFLOWS[0].parent.parent
    done = subprocess.run([sys.executable, str(root / "install.py")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch" in done.stdout
    assert "left as it is" in done.stdout
    assert "comfy-kitchen" in done.stdout
    assert "nvidia-cudnn-frontend" in done.stdout
    import importlib.util

    from adaptive_sparse_attention.kernels.cudnn.cudnn_attention import ARCHS
    from adaptive_sparse_attention.kernels.registry import FAMILIES as KERNEL_FAMILIES

    spec = importlib.util.spec_from_file_location("_install_check", root / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.kernel_table().FAMILIES is KERNEL_FAMILIES  # the report reads the package's own table
    assert module.importlib.import_module(f"{module.PACKAGE}.kernels.cudnn.family").ARCHS is ARCHS
    lines = [ln.split("#")[0].strip() for ln in (root / "requirements.txt").read_text().splitlines()]
    assert not [ln for ln in lines if ln.lower().startswith(("torch", "comfy-kitchen", "comfy_kitchen"))]


def notes_of(wf: dict) -> list[str]:
    return [n["widgets_values"][0] for n in wf["nodes"] if n["type"] in FRONTEND_ONLY]


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_notes_name_every_model_file_and_its_folder(path):
    """The canvas says which file each loader expects and where it goes (extra.note is never shown)."""
    wf = load(path)
    notes = notes_of(wf)
    assert notes, f"{path.name} has no note on the canvas"
    assert all(isinstance(t, str) and t.strip() for t in notes), f"{path.name} has no note on the canvas"
    loaders = [n for n in wf["nodes"] if n["type"] in LOADER_FOLDERS]
    assert {n["type"] for n in loaders} == set(LOADER_FOLDERS), path.name
    for node in loaders:
        name, folder = node["widgets_values"][0], LOADER_FOLDERS[node["type"]]
        assert any(name in t and folder in t for t in notes), f"{path.name}: no note says {name} goes in {folder}"
    text = "\n".join(notes)
    assert "Adaptive Sparse Attention" in text
    assert "topk_ratio" in text
    assert REPORT_NODE_NAME in text


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_every_part_sits_in_a_titled_group(path):
    """Groups with titles frame the parts; every node (notes too) lies inside one."""
    wf = load(path)
    groups = wf["groups"]
    assert groups
    assert all(g["title"].strip() and len(g["bounding"]) == 4 for g in groups)

    def inside(node, group):
        gx, gy, gw, gh = group["bounding"]
        (x, y), (w, h) = node["pos"], node["size"]
        return gx <= x and x + w <= gx + gw and gy <= y and y + h <= gy + gh

    outside = [n["type"] for n in wf["nodes"] if not any(inside(n, g) for g in groups)]
    assert not outside, f"{path.name}: outside every group: {outside}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_report_node_follows_the_sampler(path):
    """The report takes the sampler's LATENT output and the MODEL of our node, which the sampler also uses."""
    wf = load(path)
    nodes = {n["id"]: n for n in wf["nodes"]}
    reports = [n for n in wf["nodes"] if n["type"] == REPORT_NODE_ID]
    assert len(reports) == 1, f"{path.name}: {len(reports)} report nodes"
    into = {(dst, dst_slot): (src, src_slot) for _, src, src_slot, dst, dst_slot, _ in wf["links"]}
    slots = {i["name"]: k for k, i in enumerate(reports[0]["inputs"])}
    src, src_slot = into[(reports[0]["id"], slots["samples"])]
    assert nodes[src]["type"] in SAMPLERS, path.name
    assert nodes[src]["outputs"][src_slot]["type"] == "LATENT", path.name
    src, _ = into[(reports[0]["id"], slots["model"])]
    assert nodes[src]["type"] == SPARSE_NODE_ID, f"{path.name}: the report's model comes from {nodes[src]['type']}"
    model_users = {nodes[dst]["type"] for (dst, _), (s, _) in into.items() if s == src}
    assert model_users & {"BasicScheduler", "BasicGuider", *SAMPLERS}, f"{path.name}: the sampler ignores our MODEL"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_every_loader_carries_its_download(path):
    """Each model loader names its file's download the way ComfyUI's own templates do
    (`properties.models`: name, https url, directory), so the frontend's missing-models dialog
    offers it: the url ends in the widget's file name and the directory is the loader's folder."""
    from urllib.parse import urlparse

    loaders = [n for n in load(path)["nodes"] if n["type"] in LOADER_FOLDERS]
    assert loaders
    for node in loaders:
        name = node["widgets_values"][0]
        models = node.get("properties", {}).get("models")
        assert models, f"{path.name} node {node['id']}: no models entry"
        assert len(models) == 1, f"{path.name} node {node['id']}: no models entry"
        (entry,) = models
        url = urlparse(entry["url"])
        assert url.scheme == "https", entry["url"]
        assert url.netloc == "huggingface.co", entry["url"]
        assert entry["name"] == name, (entry, name)
        assert url.path.rsplit("/", 1)[1] == name, (entry, name)
        assert LOADER_FOLDERS[node["type"]] == f"models/{entry['directory']}/", entry


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_default_length_is_five_seconds_and_the_note_says_how_to_go_to_ten(path):
    """124 frames (ComfyUI's default, about 5 s; what the home-GPU VRAM section is about), and the
    clip-length note says to set 243 for 10 s."""
    wf = load(path)
    (latent,) = [n for n in wf["nodes"] if n["type"] in ("MiniMaxH3ImageToVideo", "MiniMaxH3ReferenceToVideo")]
    assert latent["widgets_values"][1:4] == [1344, 768, 124]
    assert any("`length` (124)" in t and "set `length` to 243" in t for t in notes_of(wf))


def test_output_names_are_comfyuis():
    """Get Video Components' fourth output is what ComfyUI calls it (`bit_depth`)."""
    wf = load(next(p for p in WORKFLOWS if p.stem == "h3_reference_to_video_joint_sparse"))
    (node,) = [n for n in wf["nodes"] if n["type"] == "GetVideoComponents"]
    assert [o["name"] for o in node["outputs"]] == ["images", "audio", "fps", "bit_depth"]


# The sparse node's widgets in the order saved UI workflows store their values (by position): those of
# the first release (0.1.0), then each one added since, at the end. Reordering or renaming any of them
# breaks saved workflows; one added later must be optional, so saved API prompts keep running.
FIRST_RELEASE = ("topk_ratio", "warmup_mode", "sparse_scope", "tail_granularity", "warmup_ratio", "tiling",
                 "reblock_layout", "tail", "dense_layers", "min_tokens", "block_size", "strict")
ADDED_LATER = ("dense_attention", "routing_scores", "precision", "plan_reuse", "measure_error", "error_target",
               "kernel")


def test_widget_order_is_kept_and_widgets_added_later_are_optional():
    assert tuple(w.name for w in SPARSE_WIDGETS) == FIRST_RELEASE + ADDED_LATER
    assert tuple(w.name for w in SPARSE_WIDGETS if w.optional) == ADDED_LATER
    first = {w.name: w.default for w in SPARSE_WIDGETS if not w.optional}
    assert config_from_widgets(first) == SparseConfig()  # a prompt saved by the first release
    assert config_from_widgets({**first, "precision": "bf16"}).precision == "bf16"
    assert config_from_widgets({**first, "precision": None}) == SparseConfig()
    assert config_from_widgets(first).plan_reuse == "auto"  # the default now; a saved off or on keeps its meaning
    assert [config_from_widgets({**first, "plan_reuse": v}).plan_reuse for v in ("off", "on")] == ["off", "on"]
    with pytest.raises(ValueError, match=r"missing widget values \['strict'\]"):
        config_from_widgets({k: v for k, v in first.items() if k != "strict"})


# The widgets as they were before `precision` was added: a workflow saved then has these values.
BEFORE_PRECISION = ("topk_ratio", "warmup_mode", "sparse_scope", "tail_granularity", "warmup_ratio", "tiling",
                    "reblock_layout", "tail", "dense_layers", "min_tokens", "block_size", "strict", "dense_attention",
                    "routing_scores")


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_a_workflow_saved_before_the_precision_widget_keeps_its_values(path):
    """ComfyUI's frontend fills widgets by position and leaves the missing last ones at their default: a
    workflow saved before `precision` existed gets every earlier value at its place and precision auto."""
    assert tuple(w.name for w in SPARSE_WIDGETS[:len(BEFORE_PRECISION)]) == BEFORE_PRECISION
    node = next(n for n in load(path)["nodes"] if n["type"] == SPARSE_NODE_ID)
    old = node["widgets_values"][:len(BEFORE_PRECISION)]
    filled = old + [w.default for w in SPARSE_WIDGETS[len(old):]]
    config = config_from_widgets(dict(zip((w.name for w in SPARSE_WIDGETS), filled)))
    assert config.precision == "auto"
    assert config.topk_ratio == old[0]
    assert config.routing_scores == old[-1]
