"""Nodes the end-to-end benchmark adds to its graphs (loaded by ComfyUI from a custom-node stub).

Conditioning of random text states, a MODEL pass-through that times every diffusion-model call
with CUDA events, and an output node that keeps the sampler's latent. Results go into `STATE`,
which the benchmark reads after each run: the calls, the latent, what the sampled MODEL carries
(``STATE["model"]``: weight patches such as a LoRA's, its flow shift, an attention override), the
MODEL the timer was given (``STATE["patcher"]``: the benchmark's other measurements use the model
its graphs loaded, never a second copy on the device) and the sigma schedule the sampler passed to
the first call (``STATE["schedule"]``). With ``STATE["profile_call"]`` set to n, the n-th call of
every run (0-based) also runs under torch.profiler and its kernel table is written to
``STATE["profile_dir"]/<run>.txt`` (the profiler's own overhead is in that call's time).
"""
from __future__ import annotations

import time
from typing import Any

import torch

STATE: dict[str, Any] = {"calls": [], "latent": None, "run": "", "profile_call": None, "profile_dir": None,
                         "model": {}, "schedule": None, "patcher": None}


class ASABenchConditioning:
    """Random text states [1, tokens, dim] (no text encoder needed)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0}), "tokens": ("INT", {"default": 256}),
                             "dim": ("INT", {"default": 5120})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, seed: int, tokens: int, dim: int):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, dim, generator=g), {}]],)


class CallTimer:
    """DIFFUSION_MODEL wrapper: start/end events (CUDA) or host times of every model call."""

    def __call__(self, executor, *args, **kwargs):
        if STATE["schedule"] is None:
            STATE["schedule"] = sample_sigmas(args, kwargs)
        cuda = torch.cuda.is_available()
        start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            start.record()
        try:
            if STATE["profile_call"] == len(STATE["calls"]):
                return profiled(executor, *args, **kwargs)
            return executor(*args, **kwargs)
        finally:
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            else:
                end = time.perf_counter()
            STATE["calls"].append((start, end))


def sample_sigmas(args: tuple, kwargs: dict) -> list[float] | None:
    """The sampler's sigma schedule in a model call's transformer_options, if it passed one."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, dict) and value.get("sample_sigmas") is not None:
            return [float(s) for s in value["sample_sigmas"].flatten()]
    return None


def model_info(model) -> dict:
    """What a MODEL carries that a graph's nodes put there: the number of weights with patches (a LoRA's),
    its flow shifts (video, audio), whether an attention override is set."""
    sampling = model.get_model_object("model_sampling")
    to = model.model_options.get("transformer_options", {})
    return {"patched_weights": len(model.patches), "shift": float(getattr(sampling, "shift", float("nan"))),
            "audio_shift": getattr(sampling, "audio_shift", None),
            "sigma_shift_video": to.get("minimax_h3_sigma_shift_video"),
            "attention_override": to.get("optimized_attention_override") is not None}


def profiled(executor, *args, **kwargs):
    """One model call under torch.profiler; its kernels (by device time) and host ops (by host time)
    go to ``STATE["profile_dir"]/<run>.txt``."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        out = executor(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    table = prof.key_averages()
    device_sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    text = (f"# {STATE['run']}: model call {STATE['profile_call']}\n\n## by device time\n"
            + table.table(sort_by=device_sort, row_limit=60, max_name_column_width=90)
            + "\n\n## by host time\n" + table.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=90))
    folder = Path(STATE["profile_dir"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{STATE['run']}.txt").write_text(text)
    return out


class ASABenchTimer:
    """Times every model call of the sampler that uses this MODEL; `label` only forces a re-run.

    `around` = "diffusion_model" times the diffusion model's forward (a DIFFUSION_MODEL wrapper);
    "apply_model" times ComfyUI's apply_model around it (an APPLY_MODEL wrapper), which stays
    outside what TorchCompileModel compiles, so the timer itself is never traced.
    """

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "label": ("STRING", {"default": ""})},
                "optional": {"around": (["diffusion_model", "apply_model"], {"default": "diffusion_model"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "wrap"
    CATEGORY = "testing"

    def wrap(self, model, label: str, around: str = "diffusion_model"):
        import comfy.patcher_extension as pe

        kinds = {"diffusion_model": pe.WrappersMP.DIFFUSION_MODEL, "apply_model": pe.WrappersMP.APPLY_MODEL}
        if around not in kinds:
            raise ValueError(f"ASABenchTimer.around={around!r}: expected one of {sorted(kinds)}")
        m = model.clone()
        STATE["model"], STATE["patcher"] = model_info(m), model
        m.add_wrapper_with_key(kinds[around], "asa_bench_timer", CallTimer())
        return (m,)


class ASABenchSink:
    """Keeps the sampled latent (video and audio streams flattened into one vector)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "label": ("STRING", {"default": ""})}}

    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "sink"
    CATEGORY = "testing"

    def sink(self, samples, label: str):
        t = samples["samples"]
        parts = t.unbind() if getattr(t, "is_nested", False) else [t]
        STATE["latent"] = torch.cat([p.flatten().float().cpu() for p in parts])
        return {}


def call_ms() -> list[float]:
    """Milliseconds of every recorded model call (synchronises once), then forgets them."""
    calls, STATE["calls"] = STATE["calls"], []
    if calls and isinstance(calls[0][0], float):
        return [(b - a) * 1e3 for a, b in calls]
    if calls:
        calls[-1][1].synchronize()
    return [a.elapsed_time(b) for a, b in calls]


NODE_CLASS_MAPPINGS = {"ASABenchConditioning": ASABenchConditioning, "ASABenchTimer": ASABenchTimer,
                       "ASABenchSink": ASABenchSink}
