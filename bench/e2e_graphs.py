"""The graphs the end-to-end benchmark runs: the sampler setups users run (presets) and their API prompts.

A preset is one sampler setup of a real graph, built from ComfyUI's own nodes:

- ``ksampler-19-cfg3``: UNETLoader -> KSampler (euler, simple, 19 steps, cfg 3: two model calls a
  step), the benchmark's original run shape;
- ``t2v-20``, ``turbo-8``, ``turbo-4``: ComfyUI's official MiniMax-H3 text-to-video template
  (comfyui-workflow-templates-json 0.1.123, ``video_minimax_h3_t2v.json``): UNETLoader ->
  [LoraLoaderModelOnly] -> BasicGuider (cfg 1: one model call a step) + KSamplerSelect
  ``res_multistep`` + BasicScheduler ``simple`` + RandomNoise -> SamplerCustomAdvanced. The template
  loads ``minimax_h3_fl2va_pruned_int8_convrot`` and switches the Turbo LoRA on with its step count (its
  own default: 20 steps without the LoRA, 8 with ``minimax_h3_fl2v_turbo_8step``; the 4-step LoRA is
  the template's second download). It carries no MiniMaxH3SigmaShift (the model's own shifts, video
  12 / audio 3, apply) and no ModelAttentionBackend; the FastH3 template adds both (10 / 3, "comfy
  kitchen attention"), which `sigma_shift` and `attention_backend` add to either graph.

The Turbo LoRA is a random LoRA the benchmark writes (`write_lora`) in the published file's layout
(``diffusion_model.<layer>.lora_up/lora_down.weight`` + ``.alpha``) on every DiT block's attention and
MLP projections, loaded by the real LoraLoaderModelOnly node, so ComfyUI patches the (int8_convrot)
weights as it does for the published LoRA.

Sizes (`TEMPLATE_SIZES`): the template's ResolutionSelector (16:9, multiple 32) gives 864x480 at its
default 0.4 megapixels and 1280x736 at 0.9; its frame count is ComfyMathExpression
``max(5, round(s * 24))`` snapped up to H3's 17n+5 grid (`template_frames`): 2 s -> 56 frames,
5 s -> 124, 10 s -> 243.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Preset:
    """One sampler setup of the benchmark's graphs.

    Attributes:
        name: the `--preset` value.
        steps: sampling steps.
        cfg: classifier-free guidance (1.0: BasicGuider, one model call a step).
        sampler: the sampler's name (KSampler's sampler_name or KSamplerSelect's).
        scheduler: the scheduler's name.
        custom: SamplerCustomAdvanced + BasicGuider (the templates) rather than KSampler.
        lora: the Turbo LoRA patched onto the model (LoraLoaderModelOnly), or not.
        weights: the checkpoint format the preset's graph loads (bench/checkpoints.py WEIGHTS).
        template: where the setup comes from.
    """

    name: str
    steps: int
    cfg: float
    sampler: str
    scheduler: str
    custom: bool
    lora: bool
    weights: str
    template: str


TEMPLATE = "ComfyUI's video_minimax_h3_t2v template (comfyui-workflow-templates-json 0.1.123)"
PRESETS = {p.name: p for p in (
    Preset("ksampler-19-cfg3", 19, 3.0, "euler", "simple", False, False, "bf16",
           "the benchmark's original run: KSampler, euler, 19 steps, cfg 3"),
    Preset("t2v-20", 20, 1.0, "res_multistep", "simple", True, False, "int8_convrot", TEMPLATE + ", base model"),
    Preset("turbo-8", 8, 1.0, "res_multistep", "simple", True, True, "int8_convrot", TEMPLATE + ", 8-step Turbo LoRA"),
    Preset("turbo-4", 4, 1.0, "res_multistep", "simple", True, True, "int8_convrot", TEMPLATE + ", 4-step Turbo LoRA"),
)}
DEFAULT_PRESET = "ksampler-19-cfg3"
ATTENTION_BACKENDS = ("pytorch attention", "comfy kitchen attention")  # ModelAttentionBackend's choices


def template_frames(seconds: float) -> int:
    """The template's frame count for a clip of `seconds`: max(5, round(24 s)) snapped up to 17n + 5."""
    f = max(5, round(seconds * 24))
    return f + (5 - f % 17) % 17


# clip name -> (width, height, seconds) at the template's sizes (ResolutionSelector 16:9, multiple 32)
TEMPLATE_SIZES = {"0.4mp-2s": (864, 480, 2.0), "0.9mp-5s": (1280, 736, 5.0)}
LORA_RANK = 192  # 1.79 GB in bf16 over H3's 50 blocks' four projections; the published Turbo LoRA file is 1.82 GB
LORA_LAYERS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
LORA_NAME = "asa_bench_turbo_lora.safetensors"


def write_lora(path: Path, model: dict, blocks: int, rank: int = LORA_RANK, seed: int = 0) -> int:
    """A random LoRA of `rank` on every block's attention and MLP projections, saved at `path`.

    Each layer gets ``lora_down`` [rank, in] and ``lora_up`` [out, rank] (bf16) and ``alpha`` = rank,
    scaled so the patch changes each weight by about 10% of its own spread.

    Args:
        path: the .safetensors file to write.
        model: the H3 constructor arguments of the benchmark scale (widths).
        blocks: DiT blocks of the checkpoint.
        rank: the LoRA rank (capped by the layers' widths).
        seed: random seed.
    Returns:
        the number of patched layers.
    """
    import safetensors.torch

    hidden, inner, ffn = model["hidden_size"], model["num_attention_heads"] * model["attention_head_dim"], \
        model["ffn_hidden_size"]
    shapes = {"attn.qkv_proj": (3 * inner, hidden), "attn.out_proj": (hidden, inner), "mlp.fc1": (2 * ffn, hidden),
              "mlp.fc2": (hidden, ffn)}
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(blocks):
        for layer in LORA_LAYERS:
            out, inp = shapes[layer]
            r = min(rank, out, inp)
            key = f"diffusion_model.blocks.{i}.{layer}"
            # the weights are randn * inp**-0.5; up @ down (alpha / rank = 1) has entries of spread 0.1 * inp**-0.5
            sd[f"{key}.lora_down.weight"] = torch.randn(r, inp, generator=g).to(torch.bfloat16)
            sd[f"{key}.lora_up.weight"] = (torch.randn(out, r, generator=g) * 0.1 * (r * inp) ** -0.5
                                           ).to(torch.bfloat16)
            sd[f"{key}.alpha"] = torch.tensor(float(r))
    safetensors.torch.save_file(sd, str(path))
    return blocks * len(LORA_LAYERS)


def model_nodes(ckpt: str, preset: Preset, widgets: dict | None, compile_backend: str | None,
                sigma_shift: tuple[float, float] | None, attention_backend: str | None) -> tuple[dict, list]:
    """The MODEL chain: UNETLoader -> [LoraLoaderModelOnly] -> [MiniMaxH3SigmaShift] ->
    [ModelAttentionBackend] -> [our node] -> [TorchCompileModel], in the FastH3 template's order.

    Returns:
        (prompt nodes, the link of the chain's last MODEL output).
    """
    prompt = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": ckpt, "weight_dtype": "default"}}}
    model = ["1", 0]
    chain = (("10", preset.lora, "LoraLoaderModelOnly", {"lora_name": LORA_NAME, "strength_model": 1.0}),
             ("11", sigma_shift is not None, "MiniMaxH3SigmaShift",
              dict(zip(("shift_video", "shift_audio"), sigma_shift or ()))),
             ("12", attention_backend is not None, "ModelAttentionBackend", {"attention": attention_backend}),
             ("2", widgets is not None, "AdaptiveSparseAttentionH3", widgets or {}),
             ("9", compile_backend is not None, "TorchCompileModel", {"backend": compile_backend}))
    for node, present, class_type, inputs in chain:
        if present:
            prompt[node] = {"class_type": class_type, "inputs": {"model": model, **inputs}}
            model = [node, 0]
    return prompt, model


def graph(ckpt: str, scale, frames: int, steps: int, cfg: float, widgets: dict | None, label: str,
          compile_backend: str | None = None, preset: Preset | None = None, size: tuple[int, int] | None = None,
          sigma_shift: tuple[float, float] | None = None, attention_backend: str | None = None) -> dict:
    """API-format prompt of one run: the model chain (`model_nodes`) -> timer -> the preset's sampler -> sink.

    Args:
        ckpt: the checkpoint's name in diffusion_models.
        scale: the benchmark `Scale` (text tokens and width; its width and height unless `size`).
        frames: the clip's frame count.
        steps: sampling steps (overrides the preset's).
        cfg: guidance of a KSampler preset (a template preset's BasicGuider has none: cfg 1).
        widgets: our node's widget values, or None for the graph without it.
        label: makes each run's prompt distinct (ComfyUI caches unchanged nodes).
        compile_backend: TorchCompileModel after our node, or None.
        preset: the sampler setup (default: ksampler-19-cfg3's KSampler).
        size: (width, height) of the clip, else the scale's.
        sigma_shift: (video, audio) shifts of a MiniMaxH3SigmaShift node, or None (the model's own).
        attention_backend: ModelAttentionBackend's attention, or None (no such node).
    Returns:
        the prompt; the sink is node "8".
    """
    preset = preset or PRESETS[DEFAULT_PRESET]
    width, height = size or (scale.width, scale.height)
    prompt, model = model_nodes(ckpt, preset, widgets, compile_backend, sigma_shift, attention_backend)
    around = "diffusion_model" if compile_backend is None else "apply_model"
    timed = ["3", 0]
    prompt.update({
        "3": {"class_type": "ASABenchTimer", "inputs": {"model": model, "label": label, "around": around}},
        "4": {"class_type": "ASABenchConditioning", "inputs": {"seed": 1, "tokens": scale.text_tokens, "dim": scale.text_dim}},
        "6": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": width, "height": height, "length": frames}},
        "8": {"class_type": "ASABenchSink", "inputs": {"samples": ["7", 0], "label": label}},
    })
    if not preset.custom:
        prompt["5"] = {"class_type": "ASABenchConditioning", "inputs": {"seed": 2, "tokens": scale.text_tokens,
                                                                        "dim": scale.text_dim}}
        prompt["7"] = {"class_type": "KSampler", "inputs": {
            "model": timed, "seed": 7, "steps": steps, "cfg": cfg, "sampler_name": preset.sampler,
            "scheduler": preset.scheduler, "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["6", 0],
            "denoise": 1.0}}
        return prompt
    prompt.update({
        "13": {"class_type": "RandomNoise", "inputs": {"noise_seed": 7}},
        "14": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": preset.sampler}},
        "15": {"class_type": "BasicScheduler", "inputs": {"model": timed, "scheduler": preset.scheduler,
                                                          "steps": steps, "denoise": 1.0}},
        "16": {"class_type": "BasicGuider", "inputs": {"model": timed, "conditioning": ["4", 0]}},
        "7": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["13", 0], "guider": ["16", 0],
                                                                "sampler": ["14", 0], "sigmas": ["15", 0],
                                                                "latent_image": ["6", 0]}},
    })
    return prompt
