"""End to end in real ComfyUI: the whole sampler run of one graph with and without our node.

The benchmark builds a random-weight MiniMax-H3 with ComfyUI's own model code, saves it where
UNETLoader finds it, loads ComfyUI's nodes and this pack through ComfyUI's custom-node loader,
and executes API-format graphs with ComfyUI's `PromptExecutor` (bench/e2e_graphs.py, one preset):

    UNETLoader -> [LoRA] -> [Adaptive Sparse Attention] -> timer -> KSampler (euler, cfg 3) -> sink
    or the official H3 template's BasicGuider + res_multistep + simple -> SamplerCustomAdvanced

Presets: ksampler-19-cfg3 (the original run), t2v-20, turbo-8 and turbo-4 (the t2v template, base or
with a Turbo LoRA the bench writes, on an int8_convrot checkpoint). Clips: 5s / 10s / 30s at
1344x768, and the template's sizes 0.4mp-2s (864x480, 56 frames) and 0.9mp-5s (1280x736, 124 frames).

The timer (bench/e2e_nodes.py) records every diffusion-model call with CUDA events. Per run it
reports the whole run, dense calls, the first sparse call and steady sparse calls, peak GPU
memory and the final latent's relative L2 against the graph without our node. Runs in order:
our node first with an empty Triton cache and no saved dense-kernel choice (cold), then warm,
`speed` mode, ratio 0.1, every step dense on our dense kernel (its latent error is the rounding
floor of two exact kernels), then two new clip lengths. On CUDA it also times the isolated op at the same
shape (plan, kernel, dense SDPA backends) to split a steady block.

`weights` picks the checkpoint format users load: bf16, or the random checkpoint's DiT block
Linear weights quantised with ComfyUI's own functions (bench/checkpoints.py: int8_convrot, fp8,
nvfp4); a format the device does not multiply in is refused (ComfyUI would dequantise it every
call). Per clip it also times the QKV projection on the clip's rows: ComfyUI's own
`attn.qkv_proj` on all rows against ours (the same layer's weights through our producer's
projection, in its chunks of rows), and our whole producer (projection, norm, RoPE, layout).

With a compile backend, ComfyUI's TorchCompileModel node goes after our node (after the loader
without it) and four more runs follow on the main clip: the graph without our node compiled,
the same again (compiled code reused), then ours compiled and again. Dynamo's caches are reset
before each first compiled run, so its first call holds the whole compilation (ours also compiles
its sparse steps' block variant at the first sparse call). Their timer wraps apply_model, outside
the compiled module.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import itertools
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..notices import logger
from . import comfy_memory, e2e_nodes
from .checkpoints import FORMATS, QUANTISED, SafetensorsWriter, header_bound, quantise_tensor, unsupported
from .e2e_graphs import (DEFAULT_PRESET, LORA_NAME, PRESETS, TEMPLATE_SIZES, Preset, graph, template_frames,
                         write_lora)

REPO = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"blocks (\d+) dense / (\d+) sparse; mean density ([\d.]+).*sparse attention time ([\d.]+) s")


@dataclass(frozen=True)
class Scale:
    """Model width and clip shapes of one benchmark scale."""

    model: dict
    width: int
    height: int
    frames: dict[str, int]  # clip name -> frame count
    text_tokens: int
    text_dim: int
    widgets: dict = field(default_factory=dict)  # widget values that differ from the node's defaults
    sizes: dict = field(default_factory=dict)  # clip name -> (width, height) where not the scale's

    def size(self, clip: str) -> tuple[int, int]:
        """(width, height) of a clip."""
        return self.sizes.get(clip, (self.width, self.height))


FULL = dict(hidden_size=5376, token_refiner_num_layers=2, num_attention_heads=56, attention_head_dim=128,
            ffn_hidden_size=14336, text_dim=5120)
TINY = dict(hidden_size=64, token_refiner_num_layers=1, num_attention_heads=2, attention_head_dim=32,
            ffn_hidden_size=128, latents_dim=24, audio_latents_dim=32, text_dim=48, timestep_input_dim=32,
            time_embed_hidden_size=64, time_embed_dim=32, rope_inv_freq_len=4)
SCALES = {
    "h3": Scale(FULL, 1344, 768, {"5s": 124, "10s": 243, "30s": 736, "new-length": 226, "new-length-2": 260,
                                  **{clip: template_frames(s) for clip, (_, _, s) in TEMPLATE_SIZES.items()}},
                256, 5120, sizes={clip: (w, h) for clip, (w, h, _) in TEMPLATE_SIZES.items()}),
    # the template sizes' clip names at tiny sizes (the smaller canvas and clip of the CPU check; the torch
    # reference named, as auto runs the sparse blocks dense where no fast sparse kernel runs)
    "tiny": Scale(TINY, 256, 256, {"5s": 22, "10s": 39, "new-length": 56, "new-length-2": 73, "0.4mp-2s": 22},
                  7, 48, {"min_tokens": 0, "kernel": "torch"}, sizes={"0.4mp-2s": (128, 96)}),
}


class ServerStub:
    """What PromptExecutor needs of ComfyUI's PromptServer when no client listens."""

    client_id = None
    last_node_id = None

    def send_sync(self, event: str, data: dict, sid: Any = None) -> None:
        pass


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


# ComfyUI's launch modes: the flags each sets, and the attention function ComfyUI then binds
LAUNCHES = {"default": {}, "ck": {"use_ck_attention": True}, "sage": {"use_sage_attention": True}}
LAUNCH_ATTENTION = {"ck": "attention_comfy_kitchen_int8", "sage": "attention_sage"}


def launch_unavailable_reason(launch: str) -> str | None:
    """Why ComfyUI cannot be launched as `launch` here (its flag's package is missing), or None."""
    if launch not in LAUNCHES:
        return f"launch={launch!r} is not allowed: expected one of {', '.join(LAUNCHES)}"
    if launch == "sage" and importlib.util.find_spec("sageattention") is None:
        return ("--use-sage-attention needs the sageattention package: pip install sageattention==1.0.6 "
                "(a 20 KB py3 wheel; carry it to a machine without network)")
    if launch == "ck":
        if importlib.util.find_spec("comfy_kitchen") is None:
            return "--use-ck-attention needs the comfy-kitchen package: pip install comfy-kitchen packaging"
        import comfy_kitchen

        if not getattr(comfy_kitchen, "int8_attention_is_available", lambda: False)():
            return ("--use-ck-attention needs comfy-kitchen's INT8 attention, which is not available on this "
                    "device or build (ComfyUI exits at start-up in that case)")
    return None


def set_launch(args: Any, launch: str) -> None:
    """Set the flags of launch mode `launch` on ComfyUI's parsed arguments, as its command line would.

    Must run before anything imports ``comfy.ldm.modules.attention``, which binds its attention from them.

    Args:
        args: ``comfy.cli_args.args``.
        launch: default, ck (``--use-ck-attention``) or sage (``--use-sage-attention``).
    Raises:
        ValueError: an unknown launch, or one whose package is missing (with the install command).
        RuntimeError: ComfyUI's attention module was imported already, so the flags would not apply.
    """
    reason = launch_unavailable_reason(launch)
    if reason is not None:
        raise ValueError(f"e2e --launch {launch}: {reason}")
    if LAUNCHES[launch] and "comfy.ldm.modules.attention" in sys.modules:
        raise RuntimeError(f"e2e --launch {launch}: ComfyUI's attention module is imported already; its attention "
                           "was bound from the flags it saw then")
    for flag, value in LAUNCHES[launch].items():
        setattr(args, flag, value)


def launched_attention() -> str:
    """The name of the attention function ComfyUI bound at import (``optimized_attention``)."""
    import comfy.ldm.modules.attention as attention

    return getattr(attention.optimized_attention, "__name__", repr(attention.optimized_attention))


def load_comfyui(comfyui: str, work: Path, cpu: bool, launch: str = "default", vram_gib: float | None = None,
                 dynamic_vram: bool = True):
    """ComfyUI's `nodes`, `execution` and its memory set-up in words, in this process, launched as `launch`
    (`set_launch`), with this pack and the bench nodes loaded. Its memory management starts as its main.py
    starts it (`comfy_memory.start`: comfy-aimdo's dynamic VRAM unless `dynamic_vram` is False, as
    --disable-dynamic-vram), on a card of `vram_gib` GiB where given."""
    sys.path.insert(0, comfyui)
    import comfy.cli_args

    comfy.cli_args.args.cpu = cpu
    set_launch(comfy.cli_args.args, launch)
    comfy.cli_args.args.disable_api_nodes = True
    comfy.cli_args.args.disable_dynamic_vram = not dynamic_vram
    memory = comfy_memory.start(comfy.cli_args.args, vram_gib, None if cpu else torch.cuda)
    import folder_paths

    custom = work / "custom_nodes"
    custom.mkdir(parents=True, exist_ok=True)
    if not (custom / "adaptive_sparse_attention").exists():
        os.symlink(REPO, custom / "adaptive_sparse_attention")
    # the bench nodes' module is this process's own (its STATE is read here after each run)
    (custom / "asa_bench_nodes.py").write_text(
        "from adaptive_sparse_attention.bench.e2e_nodes import NODE_CLASS_MAPPINGS  # noqa: F401\n")
    folder_paths.folder_names_and_paths["custom_nodes"] = ([str(custom)], set())
    for kind in ("diffusion_models", "loras"):
        (work / "models" / kind).mkdir(parents=True, exist_ok=True)
        folder_paths.add_model_folder_path(kind, str(work / "models" / kind), is_default=True)
    folder_paths.set_output_directory(str(work / "output"))
    import execution
    import nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))
    for name in ("AdaptiveSparseAttentionH3", "ASABenchTimer", "EmptyMiniMaxH3LatentAV", "SamplerCustomAdvanced",
                 "MiniMaxH3SigmaShift", "ModelAttentionBackend", "LoraLoaderModelOnly"):
        if name not in nodes.NODE_CLASS_MAPPINGS:
            raise RuntimeError(f"e2e: ComfyUI did not load node {name!r} (see the log above)")
    expected = LAUNCH_ATTENTION.get(launch)
    if expected is not None and launched_attention() != expected:
        raise RuntimeError(f"e2e --launch {launch}: ComfyUI bound {launched_attention()}, not {expected}")
    return nodes, execution, memory()


def meta_specs(build: Callable[[], torch.nn.Module]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of the state dict of the module `build()` makes, built on the meta device
    (no memory for its tensors anywhere)."""
    with torch.device("meta"):
        net = build()
    return {key: (tuple(t.shape), t.dtype) for key, t in net.state_dict().items()}


def h3_specs(model: dict, blocks: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of a ComfyUI MiniMax-H3 of `blocks` DiT blocks in bf16 (`model`: its
    constructor's widths; fp32 where the model keeps fp32), listed on the meta device."""
    import comfy.ops
    from comfy.ldm.minimax.model import MiniMaxH3Model

    return meta_specs(lambda: MiniMaxH3Model(**model, num_layers=blocks, dtype=torch.bfloat16,
                                             operations=comfy.ops.disable_weight_init))


def tensor_seed(key: str, seed: int = 0) -> int:
    """The generator seed of the random tensor `key`: a CRC-32 of `seed` and the name, so that a
    tensor's values depend on neither the order of the others nor the model's depth (32 bits: the
    CPU generator ignores higher ones)."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"tensor_seed: seed={seed!r}: expected a whole number >= 0")
    return zlib.crc32(f"{seed}/{key}".encode())


def random_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  seed: int = 0) -> torch.Tensor:
    """The random checkpoint's tensor `key` made on `device`: weights whose key ends in ``norm.weight``
    1 (H3's q_norm, k_norm and final norms), other tensors of fewer than two dimensions (biases, and,
    as before this builder, the blocks' norm1/norm2 weights) N(0, 0.02), matrices N(0, 1 / fan-in);
    ``rope.inv_freq`` is H3's rotary table 1 / 10000^(i / n). Each tensor is drawn from its own
    generator on `device` (`tensor_seed`): the same key, seed and device kind give the same values."""
    if key == "rope.inv_freq":
        n = shape[0]
        return (1.0 / (10000.0 ** (torch.arange(n, dtype=torch.float32) / n))).to(device=device, dtype=dtype)
    if key.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    g = torch.Generator(device).manual_seed(tensor_seed(key, seed))
    t = torch.randn(shape, generator=g, device=device, dtype=dtype)
    return t.mul_(0.02 if len(shape) < 2 else shape[-1] ** -0.5)


def write_random_checkpoint(path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                            device: torch.device, weights: str = "bf16", convrot_groupsize: int = 256,
                            seed: int = 0) -> dict[str, float]:
    """Write a random checkpoint of the tensors `specs` lists (`meta_specs`) to `path`, one tensor
    at a time: each made on `device` (`random_tensor`), its DiT block Linear weights quantised there
    unless `weights` is bf16 (`checkpoints.quantise_tensor`: the keys and ``comfy_quant`` markers of
    `quantise_state_dict`), moved to the CPU, appended to the file (`SafetensorsWriter`) and freed
    before the next. Neither the device nor the host holds more than about one tensor and its
    quantised form; the same specs, seed, format and device kind give the same bytes.

    Returns:
        the peak device memory of the build in GiB (``device_peak_gib``, CUDA only) and the largest
        tensor made in GiB (``largest_tensor_gib``).
    """
    if weights != "bf16":
        if weights not in FORMATS:
            raise ValueError(f"write_random_checkpoint: weights={weights!r} is not a format; allowed: bf16, "
                             f"{', '.join(FORMATS)}")
        if not any(QUANTISED.match(key) for key in specs):
            raise ValueError("write_random_checkpoint: the model has no DiT block Linear weights (blocks.N.attn/mlp) "
                             f"to store in {weights}")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)

    def store(key: str, t: torch.Tensor) -> int:
        """Quantise and append `t`; returns its bytes. Its locals go on return: the next tensor is made after."""
        parts = {key: t} if weights == "bf16" else quantise_tensor(key, t, weights, convrot_groupsize)
        for name, part in parts.items():
            out.add(name, part.cpu())
        return t.numel() * t.element_size()

    largest = 0
    with SafetensorsWriter(path, header_bound(specs, 1 if weights == "bf16" else 4)) as out:
        for key, (shape, dtype) in specs.items():
            largest = max(largest, store(key, random_tensor(key, shape, dtype, device, seed)))
    stats = {"largest_tensor_gib": largest / 2 ** 30}
    if cuda:
        stats["device_peak_gib"] = (torch.cuda.max_memory_allocated(device) - before) / 2 ** 30
        torch.cuda.empty_cache()
    return stats


def save_random_h3(path: Path, model: dict, blocks: int, device: torch.device, weights: str = "bf16",
                   seed: int = 0) -> dict[str, float]:
    """A random-weight H3 of `blocks` DiT blocks in bf16 (fp32 where the model keeps fp32), its
    block Linear weights quantised to `weights` (bench/checkpoints.py) unless that is bf16.

    The model is built on the meta device only to list its tensors; each tensor is then made,
    quantised and stored one at a time (`write_random_checkpoint`), so a full-depth H3 (50 blocks)
    builds on an 80 GB GPU. Deterministic: the same arguments on the same device kind give the same
    file, byte for byte (CPU and CUDA draw different values).

    Returns:
        `write_random_checkpoint`'s memory figures.
    """
    group = 256 if model["hidden_size"] % 256 == 0 and model["ffn_hidden_size"] % 256 == 0 else 64
    return write_random_checkpoint(path, h3_specs(model, blocks), device, weights, group, seed)


def node_widgets(scale: Scale, **changes: Any) -> dict:
    """The sparse node's widget values: its defaults, the scale's changes, then `changes`."""
    from ..nodes.widgets import SPARSE_WIDGETS

    values = {w.name: w.default for w in SPARSE_WIDGETS}
    values.update(scale.widgets)
    values.update(changes)
    return values


def check_widgets(widgets: dict[str, Any], scale: Scale) -> None:
    """Refuse widget values that are not the sparse node's (naming the widget, the value and what is allowed)."""
    from ..nodes.widgets import SPARSE_WIDGETS, config_from_widgets

    names = [w.name for w in SPARSE_WIDGETS]
    unknown = [name for name in widgets if name not in names]
    if unknown:
        raise ValueError(f"e2e: widgets {unknown} are not widgets of the sparse node; allowed: {', '.join(names)}")
    config_from_widgets(node_widgets(scale))  # raises naming the field, the value and what it allows


def summarise(name: str, calls: list[float], total_s: float, peak: float | None, dense_calls: int | None,
              latent: torch.Tensor, reference: torch.Tensor | None, log_lines: list[str]) -> dict:
    """One run's row. `dense_calls`: how many leading calls ran dense under our node (None: no node)."""
    row: dict[str, Any] = {"run": name, "run_s": total_s, "calls": len(calls), "call_ms": calls,
                           "median_call_ms": sorted(calls)[len(calls) // 2] if calls else None,
                           "first_call_ms": calls[0] if calls else None}
    dense = len(calls) if dense_calls is None else dense_calls
    if dense:
        row["dense_call_ms"] = sorted(calls[:dense])[dense // 2]
    sparse = calls[dense:]
    if sparse:
        row["first_sparse_ms"] = sparse[0]
        steady = sparse[2:] or sparse  # past the first step's two calls
        row["steady_sparse_ms"] = sorted(steady)[len(steady) // 2]
    if peak is not None:
        row["peak_gib"] = peak
    if reference is not None:
        row["rel_l2"] = float((latent - reference).norm() / reference.norm())
    for line in log_lines:
        if m := SUMMARY.search(line):
            row.update(dense_blocks=int(m[1]), sparse_blocks=int(m[2]),
                       density=float(m[3]), attention_s=float(m[4]))
        if m := re.search(r"kernels ready in ([\d.]+) s(?: \((\d+) compiled)?", line):
            row["prepare_s"] = row.get("prepare_s", 0.0) + float(m[1])
            row["compiled"] = row.get("compiled", 0) + int(m[2] or 0)
        if m := re.search(r"attention saved (-?[\d.]+) s against ([^;]+)", line):
            row.update(report_saved_s=float(m[1]), report_baseline=m[2])
        if m := re.search(r"measured error ([\d.]+) \(worst block \d+: ([\d.]+)\)", line):
            row.update(measured_error=float(m[1]), worst_block_error=float(m[2]))
        if m := re.search(r"plans reused (\d+), built (\d+) \((\d+) rebuilds(?:, (\d+) past the plans' memory budget)?\)",
                          line):
            row.update(plans_reused=int(m[1]), plans_built=int(m[2]), plan_rebuilds=int(m[3]),
                       plans_past_budget=int(m[4] or 0))
    return row


def clip_layout(scale: Scale, clip: str) -> Any:
    """The SequenceLayout of a clip's tokens (text, audio, video) as H3 packs them."""
    from .. import SequenceLayout

    from comfy.ldm.minimax.model import PackedLayout
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    width, height = scale.size(clip)
    latent = EmptyMiniMaxH3LatentAV.execute(width=width, height=height, length=scale.frames[clip]).result[0]
    video, audio = latent["samples"].unbind()
    return SequenceLayout.from_packed(PackedLayout(scale.text_tokens, *video.shape[2:], audio.shape[-1]))


def qkv_timing(patcher: Any, scale: Scale, clip: str, device: torch.device, reps: int = 5,
               lora: bool = False, rounds: int = 3) -> dict:
    """Milliseconds of the first block's QKV production on a clip's rows (random input in the model's
    dtype, a rotation table of H3's layout): ComfyUI's own `attn.qkv_proj(x)`, ours (`qkv_projection` in
    the producer's chunks of rows, all heads); ComfyUI's whole production (what H3's `Attention.forward`
    does before its attention: the projection, comfy-kitchen's norm + RoPE in place, v's copy) and our
    whole producer (projection, norm, RoPE, head-major layout, the epilogue ``auto`` resolves to).

    `patcher` is the MODEL of the benchmark's graph without our node (the loader's, with the preset's
    LoRA and nodes): ComfyUI loads it onto the device as it loads the graphs' model, so the timing holds
    no second copy of the model there. `lora` says the preset's Turbo LoRA is among its patches (the
    table's label): both then time the patched layer. ComfyUI's and ours alternate for `rounds` rounds
    of `reps` calls (the GPU's clock drifts between back-to-back measurements by more than the 5% being
    judged); each time is the median over rounds and the ratio the median of the rounds' ratios."""
    import comfy.model_management
    import comfy.quant_ops

    from ..backend.producer import CHUNK_ROWS, produce_qkv
    from ..kernels.registry import resolve
    from ..nodes.comfy_weights import on_device, qkv_projection
    from .timing import time_call

    comfy.model_management.load_models_gpu([patcher])
    attn = patcher.model.diffusion_model.blocks[0].attn
    rows = clip_layout(scale, clip).total
    dtype = patcher.model.get_dtype_inference()  # what the model's blocks compute in
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(rows, scale.model["hidden_size"], generator=g, device=device, dtype=dtype)
    H, D = attn.heads, attn.head_dim
    half = 3 * D // 8  # H3's table: 3 axes x 16 frequencies rotate 96 of 128 dims, in the model's dtype
    angle = torch.rand(1, rows, 1, half, generator=g, device=device)
    rope = torch.stack([torch.stack([angle.cos(), -angle.sin()], -1),
                        torch.stack([angle.sin(), angle.cos()], -1)], -2).to(dtype)
    qw, kw = on_device(attn.q_norm.weight, device), on_device(attn.k_norm.weight, device)
    norm_rope = resolve("auto", device, dtype, head_dim=D).norm_rope

    def comfyui() -> None:
        q, k, v = attn.qkv_proj(x).split(H * D, dim=-1)
        comfy.quant_ops.ck.rms_rope_split_half_(q.view(1, rows, H, D), k.view(1, rows, H, D), rope, qw, kw,
                                                epsilon=attn.q_norm.eps, rot_dim=2 * half)
        v.view(rows, H, D).clone()

    def ours() -> None:
        with qkv_projection(attn.qkv_proj, x, H, D) as projection:
            project = projection.for_heads((0, H))
            for a in range(0, rows, CHUNK_ROWS):
                project(x[a:a + CHUNK_ROWS])

    def producer() -> None:
        with qkv_projection(attn.qkv_proj, x, H, D) as projection:
            produce_qkv(x, projection, None, H, D, qw, kw, attn.q_norm.eps, rope, norm_rope=norm_rope)

    with torch.inference_mode():
        fmt = getattr(attn.qkv_proj, "quant_format", None) or str(dtype).split(".")[-1]
        theirs, mine, whole, ours_whole = [], [], [], []
        for _ in range(rounds):
            theirs.append(time_call(lambda: attn.qkv_proj(x), device, reps=reps))
            mine.append(time_call(ours, device, reps=reps))
            whole.append(time_call(comfyui, device, reps=reps))
            ours_whole.append(time_call(producer, device, reps=reps))
        out = {"rows": rows, "format": fmt + (" + LoRA" if lora else ""),
               "comfyui_qkv_proj_ms": statistics.median(theirs), "ours_projection_ms": statistics.median(mine),
               "projection_vs_comfyui": statistics.median(b / a for a, b in zip(theirs, mine)),
               "comfyui_production_ms": statistics.median(whole), "ours_producer_ms": statistics.median(ours_whole),
               "producer_vs_comfyui": statistics.median(b / a for a, b in zip(whole, ours_whole)),
               "epilogue": norm_rope.family}
    del attn, x
    return out


def reused_plan_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Any, config: Any, reps: int) -> float:
    """Median planner milliseconds of the op on a kept plan (`plan_reuse.PlanSlot`: the same q, k each call, so
    its drift check passes), the device synchronised: what a sparse step that reuses its plan spends planning
    (block means, the check, the tail summaries). Raises if a call planned afresh instead."""
    from ..backend.plan_reuse import PlanStore
    from .steps import timed_call

    store = PlanStore()
    slot = store.slot("op")
    timed_call(q, k, v, layout, config, slot)  # the fresh plan the slot keeps
    times = sorted(timed_call(q, k, v, layout, config, slot)[1] for _ in range(reps))
    counts = store.summary()
    if counts["reused"] != reps:
        raise RuntimeError(f"reused_plan_ms: {counts} after {reps} calls on one kept plan; expected {reps} reused")
    return times[reps // 2]


def isolated_op(scale: Scale, clip: str, config: Any, device: torch.device, reps: int = 5) -> dict:
    """Milliseconds of the op alone at a clip's shape: our call (plan, kernel, the plan when reused), dense SDPA
    backends and the other dense kernels of the op bench where installed (FlashAttention-4, comfy-kitchen INT8,
    Sage)."""
    from .. import sparse_attention
    from ..kernels.dense.choice import sdpa
    from .methods import DENSE_KERNELS, dense_kernel, dense_unavailable_reason
    from .timing import time_call

    layout = clip_layout(scale, clip)
    H, D = scale.model["num_attention_heads"], scale.model["attention_head_dim"]
    g = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(1, H, layout.total, D, generator=g, device=device, dtype=torch.bfloat16) for _ in range(3))

    out = {"tokens": layout.total, "op_ms": time_call(lambda: sparse_attention(q, k, v, layout, config), device, reps=reps)}
    plan, kernel = [], []
    for _ in range(reps):
        info = sparse_attention(q, k, v, layout, config, return_info=True, timings=True)[1]
        plan.append(info.timings_ms["plan"])
        kernel.append(info.timings_ms["kernel"])
    out["plan_ms"], out["kernel_ms"] = sorted(plan)[reps // 2], sorted(kernel)[reps // 2]
    out["plan_reused_ms"] = reused_plan_ms(q, k, v, layout, config, reps)
    for name in ("cudnn", "flash"):
        out[f"dense_{name}_ms"] = time_call(lambda: sdpa(q, k, v, name), device, reps=reps)
    for name in DENSE_KERNELS:  # FlashAttention-4 and the launch modes' own kernels, where installed
        if dense_unavailable_reason(name, device) is None:
            out[f"dense_{name}_ms"] = time_call(dense_kernel(name, q, k, v), device, reps=reps)
    return out


RUNS = ("comfyui", "ours-cold", "ours", "ours-unmeasured", "ours-speed", "ours-ratio-0.1", "ours-all-dense",
        "ours-reuse", "ours-ramp", "ours-ramp-reuse", "ours-new-length", "comfyui-two-threads", "ours-two-threads", "other-clips")


def prepare_ahead(work: Path) -> float:
    """Seconds of `python -m adaptive_sparse_attention prepare` (its fixed set of shapes), run in a child process
    on this benchmark's (empty) Triton cache and choice files, as the install step does before the first run."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # this package, importable
    package = __name__.split(".")[0]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", package, "prepare"], check=True, env=env, cwd=str(work))
    return time.perf_counter() - start


def resolve_preset(preset: str, steps: int | None, cfg: float | None, weights: str | None,
                   sigma_shift: tuple[float, float] | None, attention_backend: str | None
                   ) -> tuple[Preset, int, float, str]:
    """(the preset, its steps, cfg and checkpoint format, each unless given), or ValueError naming
    what does not fit it."""
    if preset not in PRESETS:
        raise ValueError(f"e2e: preset={preset!r} is not a preset; allowed: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    steps = p.steps if steps is None else steps
    cfg = p.cfg if cfg is None else cfg
    if p.custom and cfg != 1.0:
        raise ValueError(f"e2e: preset {preset} samples through BasicGuider, which has no cfg (1.0, one model call a "
                         f"step); got cfg={cfg}: use the ksampler-19-cfg3 preset for cfg > 1")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"e2e: steps={steps!r}: expected a whole number >= 1")
    if sigma_shift is not None and (len(sigma_shift) != 2 or not all(0.01 <= s <= 100.0 for s in sigma_shift)):
        raise ValueError(f"e2e: sigma_shift={sigma_shift!r}: expected (video, audio), each in [0.01, 100] "
                         "(MiniMaxH3SigmaShift's range)")
    from .e2e_graphs import ATTENTION_BACKENDS

    if attention_backend is not None and attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"e2e: attention_backend={attention_backend!r}: expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)} (ModelAttentionBackend's choices)")
    return p, steps, cfg, p.weights if weights is None else weights


def run_benchmark(comfyui: str, work: Path, scale_name: str, blocks: int, steps: int | None, cfg: float | None,
                  clips: list[str], out: Path | None = None, echo=print, compile_backend: str | None = None,
                  compile_only: bool = False, runs: tuple[str, ...] = RUNS, prepared: bool = False,
                  profile_call: int | None = None, weights: str | None = None, launch: str = "default",
                  precision: str = "auto", preset: str = DEFAULT_PRESET, sigma_shift: tuple[float, float] | None = None,
                  attention_backend: str | None = None, widgets: dict[str, Any] | None = None,
                  vram_gib: float | None = None, dynamic_vram: bool = True) -> dict:
    """Every run of the benchmark; returns (and with `out`, writes after each run) the results.

    `preset` picks the sampler setup (bench/e2e_graphs.py PRESETS); `steps`, `cfg` and `weights`
    override its own when given. `sigma_shift` (video, audio) adds a MiniMaxH3SigmaShift node and
    `attention_backend` a ModelAttentionBackend node to every graph, with and without our node (as
    the FastH3 template carries them).

    `compile_backend` (TorchCompileModel's backend: inductor or cudagraphs; eager compiles with
    dynamo alone, for CPU tests) adds the compiled runs of the main clip; `compile_only` keeps
    only those and the runs they compare with (ComfyUI, ours cold and warm). `runs` picks runs by
    name (`RUNS`; "comfyui" always runs: the others are compared with it). `prepared` runs the
    pack's `prepare` command first in a child process, and the first run of ours (then named
    ours-prepared) is the first use after it. `profile_call` n: the n-th model call of every run is
    profiled (kernel tables in WORK/profiles/<run>.txt). `weights`: the checkpoint's format
    (bench/checkpoints.py WEIGHTS), refused where the device does not multiply in it.
    `launch`: ComfyUI launched as default, ck
    (``--use-ck-attention``) or sage (``--use-sage-attention``), for every run, so each ratio is against
    the same launch without our node. `precision`: the node's precision widget in every run of ours.
    `widgets`: other widget values of every run of ours (a run that sets one itself keeps its own).
    `vram_gib`: ComfyUI runs on a card of that many GiB (bench/comfy_memory.py); `dynamic_vram` False:
    ComfyUI launched with --disable-dynamic-vram."""
    if compile_only and compile_backend is None:
        raise ValueError("e2e: compile_only needs a compile backend (--compile)")
    unknown_runs = [r for r in runs if r not in RUNS]
    if unknown_runs:
        raise ValueError(f"e2e: runs {unknown_runs!r} are not runs of the benchmark; allowed: {', '.join(RUNS)}")
    setup, steps, cfg, weights = resolve_preset(preset, steps, cfg, weights, sigma_shift, attention_backend)
    if setup.custom and any(r.endswith("two-threads") for r in runs):
        echo(f"e2e: the two-threads runs sample with KSampler, not preset {preset}'s sampler: left out")
        runs = tuple(r for r in runs if not r.endswith("two-threads"))
    reason = launch_unavailable_reason(launch)
    if reason is not None:
        raise ValueError(f"e2e --launch {launch}: {reason}")
    scale = dataclasses.replace(SCALES[scale_name],
                                widgets={**SCALES[scale_name].widgets, "precision": precision, **(widgets or {})})
    check_widgets(widgets or {}, scale)
    unknown = [clip for clip in clips if clip not in scale.frames]
    if unknown or not clips:
        raise ValueError(f"e2e: clips {unknown or clips!r} are not clips of scale {scale_name!r}; allowed: "
                         f"{', '.join(scale.frames)}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    refused = unsupported(weights, device)
    if refused:
        raise ValueError(f"e2e: {refused}")
    os.environ.setdefault("TRITON_CACHE_DIR", str(work / "triton_cache"))  # empty: the first sparse use is cold
    os.environ.setdefault("ADAPTIVE_SPARSE_DENSE_CACHE", str(work / "dense_kernels.json"))
    os.environ.setdefault("ADAPTIVE_SPARSE_SPARSE_CACHE", str(work / "sparse_kernels.json"))  # prepare's too
    lines = LogLines()
    logger().addHandler(lines)
    logger().setLevel(logging.INFO)
    nodes, execution, memory = load_comfyui(comfyui, work, cpu=not cuda, launch=launch, vram_gib=vram_gib,
                                            dynamic_vram=dynamic_vram)
    echo(f"e2e memory: {memory}")
    if compile_backend is not None and "TorchCompileModel" not in nodes.NODE_CLASS_MAPPINGS:
        raise RuntimeError("e2e: this ComfyUI has no TorchCompileModel node (comfy_extras/nodes_torch_compile.py)")
    ckpt = f"h3_random_{scale_name}_{blocks}blocks_{weights}.safetensors"
    start = time.perf_counter()
    build = save_random_h3(work / "models" / "diffusion_models" / ckpt, scale.model, blocks, device, weights)
    lora_layers = write_lora(work / "models" / "loras" / LORA_NAME, scale.model, blocks) if setup.lora else 0
    result: dict[str, Any] = {"preset": setup.name, "preset_source": setup.template, "sampler": setup.sampler,
                              "scheduler": setup.scheduler, "lora_layers": lora_layers,
                              "sigma_shift": sigma_shift, "attention_backend": attention_backend,
                              "scale": scale_name, "blocks": blocks, "steps": steps, "cfg": cfg,
                              "weights": weights, "compile": compile_backend, "qkv": {},
                              "launch": launch, "precision": precision, "widgets": dict(widgets or {}),
                              "comfyui_attention": launched_attention(), "vram_gib": vram_gib, "memory": memory,
                              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                              "model_build_s": time.perf_counter() - start,
                              **{f"model_build_{k}": v for k, v in build.items()}, "runs": [], "op": {}}
    executor = execution.PromptExecutor(ServerStub(), cache_type=execution.CacheType.CLASSIC,
                                        cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})
    from ..nodes.schedule import warmup_steps
    from ..nodes.widgets import config_from_widgets

    references: dict[str, torch.Tensor] = {}
    plain: list[Any] = []  # the MODEL of the last graph without our node: the loader's model, on the device
    counter = itertools.count()

    def run(name: str, clip: str, widgets: dict | None, n_steps: int = steps, backend: str | None = None) -> dict:
        lines.lines.clear()
        e2e_nodes.STATE["calls"].clear()
        e2e_nodes.STATE.update(run=name, profile_call=profile_call, profile_dir=str(work / "profiles"))
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        label = f"{name}-{next(counter)}"
        t0 = time.perf_counter()
        e2e_nodes.STATE["schedule"] = None
        prompt = graph(ckpt, scale, scale.frames[clip], n_steps, cfg, widgets, label, backend, setup, scale.size(clip),
                       sigma_shift, attention_backend)
        executor.execute(prompt, label, {}, ["8"])
        if not executor.success:
            raise RuntimeError(f"e2e: run {name} failed: {executor.status_messages[-1:]}")
        total = time.perf_counter() - t0
        calls = e2e_nodes.call_ms()
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
        dense = None
        if widgets is not None:
            config = config_from_widgets(widgets)
            dense = len(calls) if config.warmup_mode == "dense" else (
                len(calls) // n_steps if config.warmup_mode == "ramp" and config.topk_ratio < 1  # the first step
                else warmup_steps(config, n_steps) * len(calls) // n_steps)
        latent = e2e_nodes.STATE["latent"]
        row = summarise(name, calls, total, peak, dense, latent, references.get(clip) if widgets else None,
                        lines.lines)
        row["clip"], row["frames"], row["size"] = clip, scale.frames[clip], scale.size(clip)
        row["graph"] = sorted({node["class_type"] for node in prompt.values()})
        row["model"], row["schedule"] = dict(e2e_nodes.STATE["model"]), e2e_nodes.STATE["schedule"]
        base = next((r for r in result["runs"] if r["run"] == "comfyui" and r["clip"] == clip), None)
        if widgets is not None and base is not None and n_steps == steps:
            row["measured_saved_s"] = base["run_s"] - total  # the report's saved seconds are checked against it
        if widgets is None and n_steps == steps and backend is None:
            references[clip] = latent
        if widgets is None and backend is None:
            plain[:] = [e2e_nodes.STATE["patcher"]]
        echo(f"e2e {name} [{clip}]: run {total:.1f} s, {len(calls)} calls" +
             "".join(f", {k} {row[k]:.4g}" for k in ("dense_call_ms", "first_sparse_ms", "steady_sparse_ms",
                                                      "peak_gib", "rel_l2", "prepare_s", "report_saved_s",
                                                      "measured_saved_s") if k in row))
        result["runs"].append(row)
        if out is not None:
            out.write_text(json.dumps(result, indent=1))
        return row

    main = clips[0]
    if prepared:
        result["prepare_ahead_s"] = prepare_ahead(work)
        result["triton_files_after_prepare"] = files_in(os.environ["TRITON_CACHE_DIR"])
        echo(f"e2e prepare (child process): {result['prepare_ahead_s']:.1f} s, "
             f"{result['triton_files_after_prepare']} files in Triton's cache")
    run("load", main, None, n_steps=1)  # loads the model onto the device; not reported
    result["runs"].clear()
    run("comfyui", main, None)
    if "ours-cold" in runs or prepared:
        run("ours-prepared" if prepared else "ours-cold", main, node_widgets(scale))
    if "ours" in runs:
        run("ours", main, node_widgets(scale))
    if not compile_only:
        for name, widgets in (("ours-unmeasured", node_widgets(scale, measure_error=False)),  # the error's cost
                              ("ours-speed", node_widgets(scale, warmup_mode="speed")),
                              ("ours-ratio-0.1", node_widgets(scale, topk_ratio=0.1)),
                              ("ours-all-dense", node_widgets(scale, warmup_mode="dense")),  # the rounding floor
                              ("ours-reuse", node_widgets(scale, plan_reuse="on")),
                              ("ours-ramp", node_widgets(scale, warmup_mode="ramp")),
                              ("ours-ramp-reuse", node_widgets(scale, warmup_mode="ramp", plan_reuse="on"))):
            if name in runs:
                run(name, main, widgets)
        for name, widgets in (("comfyui-two-threads", None),
                              ("ours-two-threads", node_widgets(scale, warmup_mode="speed"))):
            if name not in runs:
                continue
            unfit = two_copies_unfit(plain[0], device)
            result[name] = ({"left_out": unfit} if unfit else
                            two_threads(nodes, plain[0], scale, main, min(steps, 6), cfg, widgets))
            echo(f"e2e {name} [{main}]: {result[name]}")
        for clip in ("new-length", "new-length-2"):
            if clip in scale.frames and "ours-new-length" in runs:
                run("ours-new-length", clip, node_widgets(scale))
    if compile_backend is not None:
        for name, widgets in (("comfyui-compiled", None), ("ours-compiled", node_widgets(scale))):
            torch.compiler.reset()  # the first run compiles from scratch: its first call is the compile time
            run(name, main, widgets, backend=compile_backend)
            run(f"{name}-warm", main, widgets, backend=compile_backend)
    for clip in clips:
        result["qkv"][clip] = qkv_timing(plain[0], scale, clip, device, lora=setup.lora)
        echo(f"e2e qkv [{clip}]: {result['qkv'][clip]}")
    if out is not None:
        out.write_text(json.dumps(result, indent=1))
    if compile_only:
        e2e_nodes.STATE["patcher"] = None  # the model goes when ComfyUI lets it go
        logger().removeHandler(lines)
        return result
    for clip in clips[1:] if "other-clips" in runs else ():
        run("comfyui", clip, None)
        run("ours", clip, node_widgets(scale))
        run("ours-ratio-1", clip, node_widgets(scale, topk_ratio=1.0))
    if cuda:
        for clip in clips:
            result["op"][clip] = isolated_op(scale, clip, config_from_widgets(node_widgets(scale)),
                                             device)
            echo(f"e2e op [{clip}]: {result['op'][clip]}")
        if out is not None:
            out.write_text(json.dumps(result, indent=1))
    result["triton_files_end"] = files_in(os.environ["TRITON_CACHE_DIR"])
    echo(f"e2e: {result['triton_files_end']} files in Triton's cache at the end")
    e2e_nodes.STATE["patcher"] = None
    logger().removeHandler(lines)
    return result


def files_in(folder: str) -> int:
    """Files under `folder` (Triton's cache: a compile adds some, a load none)."""
    return sum(len(files) for _, _, files in os.walk(folder))


def two_copies_unfit(model: Any, device: torch.device, share: float = 0.9) -> str | None:
    """Why two copies of `model` (a ModelPatcher) would not fit `device` (more than `share` of its
    memory), or None; the CPU always fits."""
    if device.type != "cuda":
        return None
    size, total = model.model_size(), torch.cuda.get_device_properties(device).total_memory
    if 2 * size <= share * total:
        return None
    return (f"its deep clone is a second copy of the {size / 2 ** 30:.1f} GiB model; two do not fit the device's "
            f"{total / 2 ** 30:.0f} GiB")


def two_threads(nodes: Any, model: Any, scale: Scale, clip: str, steps: int, cfg: float,
                widgets: dict | None) -> dict:
    """Our node's model (`model`, the MODEL of the graph without our node, patched with `widgets`; None:
    as it is) and its multi-GPU deep clone on the same device, sampled alone and then at once in two
    threads (as MultiGPU CFG Split runs its device copies): the largest difference of each concurrent
    latent from its lone run (0.0: the same bits). The deep clone is the only second copy on the device.
    Our node is the class ComfyUI loaded (`nodes`), as in the graphs: the node keeps its layouts on the
    diffusion model, which `model` shares with the graphs, so they must come from the same module."""
    import threading

    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    patched = model
    if widgets is not None:
        patched = nodes.NODE_CLASS_MAPPINGS["AdaptiveSparseAttentionH3"].execute(model=patched, **widgets).result[0]
    models = {"original": patched, "deepclone": patched.deepclone_multigpu(new_load_device=patched.load_device)}
    width, height = scale.size(clip)
    latent = EmptyMiniMaxH3LatentAV.execute(width=width, height=height, length=scale.frames[clip]).result[0]
    pos = e2e_nodes.ASABenchConditioning().make(1, scale.text_tokens, scale.text_dim)[0]
    neg = e2e_nodes.ASABenchConditioning().make(2, scale.text_tokens, scale.text_dim)[0]

    def sample(model: Any) -> torch.Tensor:
        out = nodes.common_ksampler(model, 7, steps, cfg, "euler", "simple", pos, neg, latent)[0]["samples"]
        return torch.cat([t.flatten().float().cpu() for t in out.unbind()])

    lone = {name: sample(model) for name, model in models.items()}
    together: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            together[name] = sample(models[name])
        except BaseException as err:  # reported below: a thread's failure fails the check
            errors.append(err)

    threads = [threading.Thread(target=work, args=(name,)) for name in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"e2e: two-threads run failed: {errors[0]!r}") from errors[0]
    return {f"{name}_vs_lone_max_abs": float((together[name] - lone[name]).abs().max()) for name in models} | {
        "deepclone_vs_original_max_abs": float((lone["deepclone"] - lone["original"]).abs().max())}


def default_work() -> Path:
    return Path(tempfile.mkdtemp(prefix="asa_e2e_"))


def preset_line(result: dict) -> str:
    """One line naming the preset and what its graphs carried."""
    extra = [f"MiniMaxH3SigmaShift {result['sigma_shift'][0]:g}/{result['sigma_shift'][1]:g}"
             if result.get("sigma_shift") else "the model's own sigma shift"]
    if result.get("attention_backend"):
        extra.append(f"ModelAttentionBackend '{result['attention_backend']}' in both graphs")
    if result.get("lora_layers"):
        extra.append(f"Turbo LoRA on {result['lora_layers']} layers (LoraLoaderModelOnly)")
    return (f"preset {result['preset']} ({result['preset_source']}): {result['sampler']}, {result['scheduler']}, "
            f"{result['steps']} steps, cfg {result['cfg']:g}, {result['weights']} weights, {result['blocks']} blocks; "
            + "; ".join(extra))


def markdown(result: dict) -> str:
    """The runs as a markdown table, with each run's speed-up over the graph without our node."""
    base = {r["clip"]: r for r in result["runs"] if r["run"] == "comfyui"}  # the compiled runs too are vs this

    def f(x: Any, digits: int = 0) -> str:
        return "-" if x is None else f"{x:,.{digits}f}"

    head = ("| run | clip | run s | vs ComfyUI | dense call ms | first call ms | first sparse ms | steady sparse ms "
            "| median call ms | peak GiB | density | measured error | latent rel L2 | preparing s (compiled) |\n|"
            + "---|" * 14)
    rows = [head]
    for r in result["runs"]:
        ref = base.get(r["clip"])
        speed = ref["run_s"] / r["run_s"] if ref else None
        rows.append(f"| {r['run']} | {r['clip']} ({r['frames']} frames) | {f(r['run_s'], 1)} | "
                    f"{f(speed, 2) + 'x' if speed else '-'} | {f(r.get('dense_call_ms'))} | {f(r.get('first_call_ms'))} | "
                    f"{f(r.get('first_sparse_ms'))} | {f(r.get('steady_sparse_ms'))} | {f(r.get('median_call_ms'))} | "
                    f"{f(r.get('peak_gib'), 2)} | {f(r.get('density'), 3)} | {f(r.get('measured_error'), 3)} | "
                    f"{f(r.get('rel_l2'), 4)} | {f(r.get('prepare_s'), 2)} ({f(r.get('compiled'))}) |")
    return "\n".join(rows)


def saving_markdown(result: dict) -> str:
    """The run report's saved seconds (its attention against the dense attention it would have run, per shape)
    beside the measured difference of whole runs (the graph without our node minus ours, same clip): the
    measured one also holds what the report leaves out (dense steps on our dense kernel, preparing, the rest of
    the block), so they agree only where sparse steps' attention is the whole difference."""
    rows = ["| run | clip | report: attention saved s | against | measured: ComfyUI run s - ours | report / measured |",
            "|" + "---|" * 6]
    for r in result["runs"]:
        if r.get("report_saved_s") is None:
            continue
        measured = r.get("measured_saved_s")
        share = f"{r['report_saved_s'] / measured:.2f}" if measured else "-"
        rows.append(f"| {r['run']} | {r['clip']} | {r['report_saved_s']:.2f} | {r['report_baseline']} | "
                    f"{'-' if measured is None else f'{measured:.2f}'} | {share} |")
    return "\n".join(rows)


def qkv_markdown(result: dict) -> str:
    """The QKV production per clip: ComfyUI's own layer against ours on the same rows, the projection alone
    and the whole production (+ q/k norm, RoPE, v's copy or our head-major layout)."""
    rows = ["| clip | rows | weights | ComfyUI attn.qkv_proj ms | ours (projection) ms | ours vs ComfyUI "
            "| ComfyUI + norm, RoPE, v copy ms | our producer ms (+ norm, RoPE, layout; epilogue) | ours vs ComfyUI |",
            "|" + "---|" * 9]
    for clip, t in result.get("qkv", {}).items():
        rows.append(f"| {clip} | {t['rows']:,} | {t['format']} | {t['comfyui_qkv_proj_ms']:.2f} | "
                    f"{t['ours_projection_ms']:.2f} | {t['projection_vs_comfyui']:.3f}x | "
                    f"{t['comfyui_production_ms']:.2f} | {t['ours_producer_ms']:.2f} ({t['epilogue']}) | "
                    f"{t['producer_vs_comfyui']:.3f}x |")
    return "\n".join(rows)


def split_markdown(result: dict) -> str:
    """Where a steady sparse block's time goes: our attention in the graph against the op alone."""
    rows = ["| clip | steady sparse call ms / block | our attention in graph ms / block | op alone ms (plan + kernel) "
            "| plan reused ms | rest of block ms | ComfyUI dense call ms / block | dense FA2 / cuDNN alone ms "
            "| block vs op + rest |",
            "|" + "---|" * 9]
    n = result["blocks"]
    for clip, op in result["op"].items():
        ours = next((r for r in result["runs"] if r["run"] == "ours" and r["clip"] == clip), None)
        dense = next((r for r in result["runs"] if r["run"] == "comfyui" and r["clip"] == clip), None)
        if not ours or not dense or not ours.get("sparse_blocks"):
            continue
        block = ours["steady_sparse_ms"] / n
        in_graph = ours["attention_s"] * 1e3 / ours["sparse_blocks"]
        rest = dense["median_call_ms"] / n - op["dense_flash_ms"]  # ComfyUI's dense block minus its attention
        rows.append(f"| {clip} | {block:.1f} | {in_graph:.1f} | {op['op_ms']:.1f} ({op['plan_ms']:.1f} + "
                    f"{op['kernel_ms']:.1f}) | {op['plan_reused_ms']:.1f} | {rest:.1f} | "
                    f"{dense['median_call_ms'] / n:.1f} | "
                    f"{op['dense_flash_ms']:.1f} / {op['dense_cudnn_ms']:.1f} | {block / (op['op_ms'] + rest):.2f} |")
    return "\n".join(rows)
