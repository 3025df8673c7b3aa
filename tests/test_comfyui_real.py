"""Against a real ComfyUI checkout (COMFYUI_PATH), on the CPU, with a tiny random-weight MiniMax-H3.

Skipped unless COMFYUI_PATH points at a ComfyUI checkout whose Python environment is the one
running pytest. KJNODES_PATH may point at a ComfyUI-KJNodes checkout to also run the low-VRAM
composition and to check its node types in /object_info.

In process: the checkpoint goes UNETLoader -> our node -> KSampler (cfg > 1); the sparse path
runs after the warmup, ratio 1.0 reproduces the unpatched model, weight patches (what LoRA
loaders add) and KJNodes' low-VRAM patches compose, and the capture node writes a file that
round-trips. Through the headless server: the same graph posted to /prompt, and every node type
of our bundled workflows present in /object_info.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from comfyui_harness import (CKPT, COMFYUI, FRONTEND_ONLY, LATENT, SPARSE, SUMMARY, TINY, comfy, needs_comfyui, sample, sparse,  # noqa: F401
                             summaries)

KJNODES = os.environ.get("KJNODES_PATH", "")
REPO = Path(__file__).resolve().parent.parent
pytestmark = needs_comfyui

def test_loader_node_ksampler_runs_sparse_after_warmup(comfy, caplog):
    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    dense = sample(nodes, model)
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        approx = sample(nodes, sparse(model))
        cubes = sample(nodes, sparse(model, tiling="cube", tail="mean", tail_granularity="block"))
        exact = sample(nodes, sparse(model, topk_ratio=1.0))
    # 4 steps, warmup ceil(0.25 * 4) = 1 step; cfg > 1: two calls per step, 2 blocks per call
    assert summaries(caplog) == [(1, 3, 4, 12)] * 3
    torch.testing.assert_close(exact, dense, rtol=1e-4, atol=1e-4)  # ratio 1.0 is dense attention
    for out in (approx, cubes):
        assert torch.isfinite(out).all()
        assert (out - dense).abs().max() > 1e-6
    other = model.clone()
    flux_like = torch.nn.Module()  # another DiT: blocks, but not H3's
    flux_like.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 2)
    other.add_object_patch("diffusion_model", flux_like)
    with pytest.raises(ValueError, match="only patches ComfyUI's MiniMax-H3 model.*Module"):
        sparse(other, dense_layers="40")  # the model is refused before its layer indices are checked
    with pytest.raises(TypeError, match="model must be a ComfyUI MODEL"):
        sparse("not a model")


@pytest.mark.parametrize("how", ["TorchCompileModel", "dynamic", "per-block"])
def test_compiled_model_samples_as_eager(comfy, caplog, how):
    """ComfyUI's compile wrapper after our node, as its TorchCompileModel node sets it (the whole
    diffusion model, guards under transformer_options dropped), with dynamic shapes, and per block
    (the keys KJNodes' compile nodes pass): dynamo alone (backend "eager"), so the compiled run
    computes what the eager one does, step for step, and the report counts the same sparse blocks.
    This run does not reproduce the decision frozen by a dropped guard that the GPU showed (the
    code before the fix passes it too); `tests/test_compile.py`'s stand-in, whose block loop breaks
    the graph in every block, does."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from comfy_extras.nodes_torch_compile import skip_torch_compile_dict

    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        eager = sample(nodes, sparse(model))
        compiled_model = sparse(model).clone(disable_dynamic=True)
        keys = [f"diffusion_model.blocks.{i}" for i in range(TINY["num_layers"])] if how == "per-block" else None
        set_torch_compile_wrapper(model=compiled_model, backend="eager", keys=keys,
                                  options={"guard_filter_fn": skip_torch_compile_dict},
                                  dynamic=True if how == "dynamic" else None)
        torch.compiler.reset()
        try:
            compiled = sample(nodes, compiled_model)
        finally:
            torch.compiler.reset()
    assert summaries(caplog) == [(1, 3, 4, 12)] * 2  # the warmup step dense, then every block sparse
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_weight_patches_compose(comfy):
    """LoRA loaders add weight patches; our producer must see the patched weights."""
    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    lora = model.clone()
    g = torch.Generator().manual_seed(3)
    for i in range(TINY["num_layers"]):
        key = f"diffusion_model.blocks.{i}.attn.qkv_proj.weight"
        shape = model.get_model_object(key).shape
        lora.add_patches({key: (0.05 * torch.randn(shape, generator=g),)}, 1.0)
    dense = sample(nodes, lora)
    assert (dense - sample(nodes, model)).abs().max() > 1e-4  # the patch matters
    torch.testing.assert_close(sample(nodes, sparse(lora, topk_ratio=1.0)), dense, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not os.path.isfile(os.path.join(KJNODES, "nodes", "minimax_nodes.py")),
                    reason="set KJNODES_PATH to a ComfyUI-KJNodes checkout to test the low-VRAM composition")
def test_kjnodes_low_vram_chain_composes(comfy, caplog):
    _, nodes = comfy
    spec = importlib.util.spec_from_file_location("kj_minimax_nodes", os.path.join(KJNODES, "nodes", "minimax_nodes.py"))
    kj = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kj)
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    dense = sample(nodes, model)
    low = kj.MiniMaxLowVRAMAttention.execute(model, head_chunks=2).result[0]
    low = kj.MiniMaxChunkFeedForward.execute(low, chunks=2, seq_threshold=256).result[0]
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        exact = sample(nodes, sparse(low, topk_ratio=1.0))  # our node after KJNodes' patches
        before = sample(nodes, kj.MiniMaxLowVRAMAttention.execute(sparse(model, topk_ratio=1.0), head_chunks=2).result[0])
    torch.testing.assert_close(exact, dense, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(before, dense, rtol=1e-4, atol=1e-4)
    assert summaries(caplog) == [(1, 3, 4, 12), (1, 3, 4, 12)]


def test_capture_node_writes_a_loadable_file(comfy):
    base, nodes = comfy
    from adaptive_sparse_attention.nodes.capture import load_capture
    from adaptive_sparse_attention.nodes.capture_node import CaptureH3Attention

    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    captured = CaptureH3Attention.execute(model, layers="0,1", steps="1,2", filename_prefix="caps/tiny").result[0]
    sample(nodes, captured)
    files = sorted((base / "output" / "caps").glob("tiny_*.safetensors"))
    assert [f.name for f in files] == ["tiny_00001_step001.safetensors", "tiny_00001_step002.safetensors"]
    entries, layout, meta = load_capture(str(files[0]))
    assert [(e["layer"], e["step"]) for e in entries] == [(0, 1), (1, 1)]
    assert entries[0]["q"].shape == (1, 2, layout.total, 32)
    assert layout.total == 7 + 2 * 37 + 448
    assert meta["total_steps"] == 4
    assert meta["heads"] == 2
    assert torch.isfinite(entries[1]["v"]).all()
    assert "measured_error" not in meta  # no sparse node measured anything


def test_capture_after_the_sparse_node_saves_its_measured_error(comfy):
    """With the sparse node on the model, each captured (layer, step) carries the error that node measured there,
    per head, in the file's meta (what a user sends with the attention inputs)."""
    base, nodes = comfy
    from adaptive_sparse_attention import SparseConfig
    from adaptive_sparse_attention.nodes.capture import load_capture
    from adaptive_sparse_attention.nodes.capture_node import CaptureH3Attention
    from adaptive_sparse_attention.nodes.sparse_policy import apply_sparse_attention

    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    config = SparseConfig(kernel="torch", tiling="cube", topk_ratio=0.25, warmup_ratio=0.3, min_tokens=0)
    captured = CaptureH3Attention.execute(apply_sparse_attention(model, config), layers="0,1", steps="2",
                                          filename_prefix="caps/measured").result[0]
    sample(nodes, captured)
    (path,) = sorted((base / "output" / "caps").glob("measured_*.safetensors"))
    _, _, meta = load_capture(str(path))
    assert set(meta["measured_error"]) == {"0/2", "1/2"}
    assert all(len(e) == 2 and all(0 < x < 1 for x in e) for e in meta["measured_error"].values())


# --- the headless server ----------------------------------------------------------------------
TEST_NODES = '''
import torch


class ASATestConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0}), "tokens": ("INT", {"default": 7}),
                             "dim": ("INT", {"default": 48})}}
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed, tokens, dim):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, dim, generator=g), {}]],)


class ASATestSink:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",)}}
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "sink"
    CATEGORY = "testing"

    def sink(self, samples):
        t = samples["samples"]
        parts = t.unbind() if getattr(t, "is_nested", False) else [t]
        return {"ui": {"finite": [bool(torch.isfinite(p).all()) for p in parts]}}


NODE_CLASS_MAPPINGS = {"ASATestConditioning": ASATestConditioning, "ASATestSink": ASATestSink}
'''


def get_json(url: str, data: dict | None = None, timeout: float = 10.0) -> dict:
    body = None if data is None else json.dumps(data).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(comfy, tmp_path_factory):
    """`python main.py --cpu` on a free loopback port with our pack (and KJNodes when given) installed."""
    base, _ = comfy
    custom = base / "custom_nodes"
    custom.mkdir(exist_ok=True)
    os.symlink(REPO, custom / "adaptive_sparse_attention")
    if KJNODES and os.path.isfile(os.path.join(KJNODES, "__init__.py")):
        os.symlink(KJNODES, custom / "ComfyUI-KJNodes")
    (custom / "asa_test_nodes.py").write_text(TEST_NODES)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                             "--disable-auto-launch", "--disable-api-nodes", "--base-directory", str(base)],
                            cwd=COMFYUI, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(base / "stubs")] + [p for p in [os.environ.get("PYTHONPATH")] if p])})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                get_json(url + "/system_stats", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("ComfyUI did not start:\n" + log_path.read_text()[-3000:])
                time.sleep(1)
        yield url, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
        shutil.rmtree(custom, ignore_errors=True)


def sparse_prompt(**changes) -> dict:
    """API prompt: loader -> our node (SPARSE plus `changes`) -> KSampler -> sink."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": CKPT, "weight_dtype": "default"}},
        "2": {"class_type": "AdaptiveSparseAttentionH3", "inputs": {"model": ["1", 0], **SPARSE, **changes}},
        "3": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": LATENT},
        "4": {"class_type": "ASATestConditioning", "inputs": {"seed": 1, "tokens": 7, "dim": 48}},
        "5": {"class_type": "ASATestConditioning", "inputs": {"seed": 2, "tokens": 7, "dim": 48}},
        "6": {"class_type": "KSampler", "inputs": {"model": ["2", 0], "seed": 3, "steps": 4, "cfg": 3.0,
                                                   "sampler_name": "euler", "scheduler": "simple", "positive": ["4", 0],
                                                   "negative": ["5", 0], "latent_image": ["3", 0], "denoise": 1.0}},
        "7": {"class_type": "ASATestSink", "inputs": {"samples": ["6", 0]}},
    }


def wait_history(url: str, log_path: Path, prompt_id: str, seconds: float = 240) -> dict:
    """The history entry of a queued prompt once it has finished."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        history = get_json(f"{url}/history/{prompt_id}").get(prompt_id)
        if history and history.get("status", {}).get("completed") is not None:
            return history
        time.sleep(0.5)
    pytest.fail(f"the prompt did not finish in {seconds} s:\n" + log_path.read_text()[-3000:])


def run_prompt(url: str, log_path: Path, prompt: dict, seconds: float = 240) -> dict:
    """Queue `prompt` and wait for its history entry."""
    return wait_history(url, log_path, get_json(url + "/prompt", {"prompt": prompt})["prompt_id"], seconds)


def queue_and_listen(url: str, prompt: dict, timeout: float = 240.0) -> tuple[str, dict[str, str]]:
    """Queue `prompt` as a websocket client, as the frontend does; returns its id and the progress
    text each node sent that client (binary event 3: node id length, node id, UTF-8 text)."""
    import asyncio
    import struct

    import aiohttp

    async def run():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{url}/ws?clientId=asa-test") as ws:
                async with session.post(url + "/prompt", json={"prompt": prompt, "client_id": "asa-test"}) as r:
                    prompt_id = (await r.json())["prompt_id"]
                texts = {}
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.BINARY and struct.unpack(">I", msg.data[:4])[0] == 3:
                        n = struct.unpack(">I", msg.data[4:8])[0]
                        texts[msg.data[8:8 + n].decode()] = msg.data[8 + n:].decode()
                    elif msg.type == aiohttp.WSMsgType.TEXT:
                        event = json.loads(msg.data)
                        if event["type"] in ("executing", "execution_error") and \
                                event["data"].get("prompt_id") == prompt_id and event["data"].get("node") is None:
                            break
                return prompt_id, texts

    return asyncio.run(asyncio.wait_for(run(), timeout))


def test_server_prompt_runs_the_sparse_path(server):
    url, log_path = server
    prompt = sparse_prompt()
    prompt["8"] = {"class_type": "SparseAttentionReportH3", "inputs": {"samples": ["6", 0], "model": ["2", 0]}}
    prompt_id, progress_text = queue_and_listen(url, prompt)
    history = wait_history(url, log_path, prompt_id)
    assert history["status"]["status_str"] == "success", json.dumps(history["status"])[:3000]
    assert history["outputs"]["7"]["finite"] == [True, True]
    report = history["outputs"]["8"]["text"][0]  # what the report node shows, read through the API
    assert report.startswith("Sparse steps (0-based): 1-3; dense-only steps: 0\nBlock calls: 12 sparse, 4 dense; "
                             "layers that ran sparse: 0-1; layers always dense: none\n"), report
    # the torch reference was named (kernel="torch"), so the CPU's sparse blocks ran sparse, unannounced
    assert "no fast sparse kernel" not in report, report
    # the error every sparse step measured on its sampled exact rows, with what it means
    assert re.search(r"\nMeasured error \(relative L2 of video rows against dense attention, on sampled exact rows\): "
                     r"run mean 0\.\d{3}; worst block [01] \(0\.\d{3}\); worst head [01] of block [01] "
                     r"\(0\.\d{3}\); per step: 1: 0\.\d{3}, 2: 0\.\d{3}, 3: 0\.\d{3}\n  \(for scale: ", report), report
    assert re.search(r"Why blocks ran dense:\n- warmup \(sigma above [0-9.]+, the sigma at warmup_ratio=0.25\): "
                     r"4 block calls$", report), report
    assert progress_text == {"8": report}  # the text the frontend draws on the node
    found = [tuple(map(int, m.groups())) for m in SUMMARY.finditer(log_path.read_text())]
    assert found == [(1, 3, 4, 12)], log_path.read_text()[-3000:]


def test_workflow_node_types_exist_in_object_info(server):
    url, _ = server
    info = get_json(url + "/object_info", timeout=60)
    assert {"AdaptiveSparseAttentionH3", "CaptureH3Attention", "SparseAttentionReportH3"} <= set(info)
    assert info["SparseAttentionReportH3"]["output_node"] is True
    assert "/extensions/adaptive_sparse_attention/report.js" in get_json(url + "/extensions")  # WEB_DIRECTORY
    ours = info["AdaptiveSparseAttentionH3"]["input_order"]
    from adaptive_sparse_attention.nodes.widgets import SPARSE_WIDGETS

    # the frontend lays widgets out required first, then optional: the order of SPARSE_WIDGETS
    assert ours["required"] + ours["optional"] == ["model"] + [w.name for w in SPARSE_WIDGETS]
    assert ours["optional"] == [w.name for w in SPARSE_WIDGETS if w.optional]
    from adaptive_sparse_attention.nodes.widgets import SPARSE_SEARCH_ALIASES

    assert info["AdaptiveSparseAttentionH3"]["search_aliases"] == list(SPARSE_SEARCH_ALIASES)
    third_party = {"MiniMaxLowVRAMAttention", "MiniMaxChunkFeedForward"}  # ComfyUI-KJNodes
    kj_installed = KJNODES and os.path.isfile(os.path.join(KJNODES, "__init__.py"))
    missing = {}
    for path in sorted((REPO / "workflows").glob("*.json")):
        for node in json.loads(path.read_text())["nodes"]:
            known = node["type"] in info or node["type"] in FRONTEND_ONLY
            if not known and (kj_installed or node["type"] not in third_party):
                missing.setdefault(path.name, []).append(node["type"])
    assert not missing, f"node types missing from /object_info: {missing}"


def ui_to_api(workflow: dict, info: dict) -> dict:
    """API-format prompt of a UI-format workflow: links become [node, slot], widget values named in order."""
    links = {lk[0]: lk for lk in workflow["links"]}
    prompt = {}
    for node in workflow["nodes"]:
        if node["type"] in FRONTEND_ONLY:
            continue  # notes are not part of a prompt
        spec = info[node["type"]]
        specs = {**spec["input"].get("required", {}), **spec["input"].get("optional", {})}
        order = spec["input_order"].get("required", []) + spec["input_order"].get("optional", [])
        linked = {i["name"]: i["link"] for i in node.get("inputs", []) if i.get("link") is not None}
        inputs = {name: [str(links[lid][1]), links[lid][2]] for name, lid in linked.items()}
        values = list(node.get("widgets_values") or [])
        for name in order:
            kind, options = specs[name][0], (specs[name][1] if len(specs[name]) > 1 else {}) or {}
            widget = isinstance(kind, list) or kind in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO") \
                or str(kind).startswith("COMFY_DYNAMICCOMBO")
            if not widget or name in linked or not values:
                continue
            inputs[name] = values.pop(0)
            if options.get("control_after_generate"):
                values.pop(0)  # the frontend stores "fixed"/"randomize" right after a seed
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def test_workflows_pass_server_validation_except_missing_files(server):
    """ComfyUI validates every widget value of every node; only the model and media files may be missing here."""
    url, _ = server
    info = get_json(url + "/object_info", timeout=60)
    missing_files = {("value_not_in_list", k) for k in ("unet_name", "clip_name", "vae_name")} | {
        ("custom_validation_failed", "image"), ("custom_validation_failed", "file")}
    checked = 0
    for path in sorted((REPO / "workflows").glob("*.json")):
        workflow = json.loads(path.read_text())
        if any(n["type"] not in info and n["type"] not in FRONTEND_ONLY for n in workflow["nodes"]):
            continue  # third-party nodes not installed (test_workflow_node_types_exist_in_object_info covers it)
        try:
            get_json(url + "/prompt", {"prompt": ui_to_api(workflow, info)})
            pytest.fail(f"{path.name} was queued although its model files do not exist")
        except urllib.error.HTTPError as err:
            body = json.loads(err.read())
        problems = [(nid, e["type"], e.get("extra_info", {}).get("input_name"), e.get("details"))
                    for nid, ne in body.get("node_errors", {}).items() for e in ne["errors"]]
        assert problems, (path.name, problems)
        assert all((kind, name) in missing_files for _, kind, name, _ in problems), (path.name, problems)
        checked += 1
    assert checked >= 3


def capture_prompt(**widgets) -> dict:
    """sparse_prompt with the capture node between the loader and the sampler instead."""
    prompt = sparse_prompt()
    prompt["8"] = {"class_type": "CaptureH3Attention", "inputs": {
        "model": ["1", 0], **{"layers": "0", "steps": "1", "filename_prefix": "caps/hostile", **widgets}}}
    prompt["6"]["inputs"]["model"] = ["8", 0]
    return prompt


def test_hostile_widget_values_are_refused_and_the_server_keeps_serving(server):
    """A shared workflow with hostile widget strings: refused at /prompt by our validate_inputs
    (malformed or unbounded strings) or when our node runs (values ComfyUI lets through, such as
    NaN from JSON, and layers the model does not have), each time with a message naming the
    widget; afterwards the server still answers and runs a good prompt."""
    url, log_path = server
    at_the_door = [  # (prompt, widget, text in the message)
        (sparse_prompt(dense_layers="0-99999999999999999999"), "dense_layers", "out of range: expected indices 0-1023"),
        (sparse_prompt(dense_layers="0-2," * 2000), "dense_layers", "at most 1024 characters"),
        (sparse_prompt(dense_layers="0;rm -rf /"), "dense_layers", "is not an index or a range"),
        (sparse_prompt(block_size=100), "block_size", "=100 is not allowed: expected one of 64, 128"),
        (sparse_prompt(error_target=0.1, measure_error=False), "error_target", "not allowed with measure_error=False"),
        (sparse_prompt(error_target=0.1, topk_ratio=0.8), "topk_ratio", "not allowed with error_target=0.1"),
        (capture_prompt(layers="1-" + "9" * 500), "layers", "out of range"),
        (capture_prompt(steps="1e9"), "steps", "is not an index or a range"),
        (capture_prompt(filename_prefix="a\x00b"), "filename_prefix", "printable characters"),
    ]
    for prompt, widget, text in at_the_door:
        start = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as err:
            get_json(url + "/prompt", {"prompt": prompt})
        assert time.monotonic() - start < 5
        body = json.loads(err.value.read())
        details = [e.get("details", "") for errors in body["node_errors"].values() for e in errors["errors"]]
        assert any(f".{widget}=" in d and text in d for d in details), (widget, details)
    when_run = [
        (sparse_prompt(topk_ratio=float("nan")), "SparseConfig.topk_ratio=nan is not allowed"),
        (sparse_prompt(dense_layers="0,1,2-5"), "Adaptive Sparse Attention (MiniMax-H3).dense_layers='0,1,2-5' is "
                                                 "not allowed: 2-5 out of range: expected indices 0-1 (the model has 2 "
                                                 "layers)"),
        (capture_prompt(layers="0-7"), "layers='0-7' is not allowed: 2-7 out of range: expected indices 0-1"),
        (capture_prompt(filename_prefix="../../outside"), "must name a file inside the output folder"),
    ]
    for prompt, text in when_run:
        history = run_prompt(url, log_path, prompt, seconds=60)
        assert history["status"]["status_str"] == "error"
        errors = [m[1] for m in history["status"]["messages"] if m[0] == "execution_error"]
        assert errors, errors
        assert text in errors[0]["exception_message"], errors
        assert errors[0]["exception_type"].endswith(("errors.SparseAttentionError", "TypeError"))  # the pack's own
    get_json(url + "/system_stats")
    assert run_prompt(url, log_path, sparse_prompt(topk_ratio=0.5))["status"]["status_str"] == "success"


def test_a_prompt_saved_before_the_later_widgets_is_queued_and_runs(server):
    """An API prompt without the widgets added after the first release (precision among them) passes
    ComfyUI's validation at /prompt and runs with their defaults."""
    from adaptive_sparse_attention.nodes.widgets import SPARSE_WIDGETS

    url, log_path = server
    prompt = sparse_prompt()
    later = [w.name for w in SPARSE_WIDGETS if w.optional]
    assert "precision" in later
    for name in later:
        del prompt["2"]["inputs"][name]
    history = run_prompt(url, log_path, prompt)
    assert history["status"]["status_str"] == "success", json.dumps(history["status"])[:3000]
    assert history["outputs"]["7"]["finite"] == [True, True]


def test_bundled_workflows_are_listed_and_served_as_templates(server):
    """Each file of workflows/ is listed once under the pack's folder name and served unchanged."""
    url, _ = server
    expected = sorted(p.stem for p in (REPO / "workflows").glob("*.json"))
    listed = get_json(url + "/api/workflow_templates")["adaptive_sparse_attention"]
    assert sorted(listed) == expected, listed
    for name in expected:
        served = get_json(f"{url}/api/workflow_templates/adaptive_sparse_attention/{name}.json")
        assert served == json.loads((REPO / "workflows" / f"{name}.json").read_text(encoding="utf-8"))
