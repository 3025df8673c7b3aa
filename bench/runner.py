"""Run methods over cases (generated scenes or captured activations) and collect result rows.

Every case is measured against dense attention on the same input in the same run: the dense
output is the quality reference and the dense time the speed reference (`speedup` = dense ms /
method ms). A method that cannot run here is reported once and skipped; a method that fails on
one input is recorded with its error and the run goes on.
"""
from __future__ import annotations

import datetime
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from ..errors import SparseAttentionError
from ..backend.layout import SequenceLayout
from ..kernels import registry
from .methods import expand_methods, prepare, split_spec, unavailable_reason
from .metrics import quality_report, sample_rows
from .scenes import SceneSize, make_scene, with_heads
from .timing import time_call


@dataclass(frozen=True)
class Preset:
    """A benchmark size: scene size key, scenes, sampled query rows per group, timing reps."""

    size: str
    scenes: tuple[str, ...]
    rows_per_group: int
    warmup: int
    reps: int
    needs_cuda: bool


PRESETS = {
    "demo": Preset("demo", ("pan",), 32, 0, 1, False),
    "cpu-small": Preset("cpu-small", ("pan", "cuts", "gaussian"), 64, 0, 2, False),
    "h3-5s": Preset("h3-5s", ("pan", "cuts"), 128, 2, 5, True),
    "h3-10s": Preset("h3-10s", ("pan", "cuts"), 128, 1, 3, True),
    "h3-14s": Preset("h3-14s", ("pan", "cuts"), 128, 1, 3, True),
    "h3-30s": Preset("h3-30s", ("pan",), 64, 0, 2, True),  # long clips: dense takes seconds per call
    "h3-60s": Preset("h3-60s", ("pan",), 64, 0, 1, True),
}


@dataclass
class Case:
    """One input to measure: a name and q, k, v [B, H, S, D] with their layout."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: SequenceLayout


def bench_dtype(device: torch.device) -> torch.dtype:
    """The scenes' dtype: bf16 on CUDA, fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_kernel(requested: str, device: torch.device) -> str:
    """Kernel family `ours` runs with on `device`: the engine's own choice for `requested` at the
    bench's dtype."""
    return registry.resolve_family(requested, device, bench_dtype(device))


def scene_cases(size: SceneSize, scenes: Iterable[str], seed: int, device: torch.device) -> Iterator[Case]:
    """Generate the scenes at `size` one at a time (`bench_dtype`)."""
    dtype = bench_dtype(device)
    for name in scenes:
        s = make_scene(name, size, seed, device, dtype)
        yield Case(name, s.q, s.k, s.v, s.layout)


def ratio_list(spec: str, ratios: list[float]) -> list[float | None]:
    """The ratios `spec` runs at: its own ``@`` list, the run's list, or [None] if it takes none."""
    base, fixed = split_spec(spec)
    return [None] if base.partition(":")[0] == "dense" or base.startswith("sol:tau=") else list(fixed or ratios)


def environment(device: torch.device) -> dict[str, str]:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "torch": torch.__version__, "python": platform.python_version(), "device": device.type,
           "command": " ".join(["python -m adaptive_sparse_attention"] + sys.argv[1:])}
    env["hardware"] = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("comfy-kitchen", "nvidia-cudnn-frontend"):
        try:
            env[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return env


def _summary(report: dict[str, dict[str, float | None]]) -> dict[str, float | None]:
    """Headline numbers: target-video rows, plus the worst context-row error."""
    video = report.get("video", {})
    ctx = [v["rel_l2"] for g, v in report.items() if g not in ("video", "ref_video")]
    return {"recall": video.get("recall"), "recall_min_head": video.get("recall_min_head"),
            "rel_l2": video.get("rel_l2"), "cosine": video.get("cosine"), "logmass_err": video.get("logmass_err"),
            "ctx_rel_l2": max(ctx) if ctx else None}


def run_cases(cases: Iterable[Case], n_cases: int, methods: list[str], ratios: list[float], device: torch.device,
              backend: str, rows_per_group: int, warmup: int, reps: int, seed: int = 0, deadline: float | None = None,
              log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> list[dict]:
    """Measure every method (at every ratio where it takes one) on every case; returns result rows.

    Dense always runs first on each case (it is the reference). Past `deadline` (time.monotonic())
    the remaining runs are recorded as not run, so a time-limited run still writes its results.
    """
    methods = ["dense"] + [m for m in expand_methods(methods) if split_spec(m)[0] != "dense"]
    runs_per_case = sum(len(ratio_list(m, ratios)) for m in methods)
    total, done, rows = n_cases * runs_per_case, 0, []
    skipped: set[str] = set()
    for case in cases:
        head_dim = case.q.shape[-1]
        sampled = sample_rows(case.layout, rows_per_group, seed)
        ref = None
        dense_ms = None
        for full_spec in methods:
            spec = split_spec(full_spec)[0]
            reason = unavailable_reason(spec, device, head_dim)
            for ratio in ratio_list(full_spec, ratios):
                done += 1
                tag = f"[{done}/{total}] {case.name} {spec}" + (f" r={ratio:g}" if ratio is not None else "")
                if reason is not None:
                    if spec not in skipped:
                        log(f"{tag}: skipped: {reason}")
                        skipped.add(spec)
                    continue
                row = {"case": case.name, "method": spec, "ratio": ratio}
                if deadline is not None and time.monotonic() > deadline:
                    row["error"] = "not run: time budget spent"
                    rows.append(row)
                    continue
                try:
                    if spec != "dense" and ref is None:
                        raise RuntimeError("no dense reference for this case (dense failed)")
                    prep = prepare(spec, case.q, case.k, case.v, case.layout, ratio, backend)
                    out = prep.result()
                    if spec == "dense":
                        ref = out
                    report = None if spec == "dense" else quality_report(case.q, case.k, case.layout, out, ref, prep.plan, sampled)
                    del out
                    ms = time_call(prep.call, device, warmup, reps)
                    if spec == "dense":
                        dense_ms = ms
                    row.update(density=prep.density, ms=ms, plan_ms=prep.plan_ms,
                               speedup=(dense_ms / ms) if dense_ms else None,
                               tflops=kernel_tflops(case.q.shape, prep.density, ms, prep.plan_ms))
                    if prep.note:
                        row["note"] = prep.note
                    if report is not None:  # dense is the reference itself
                        row.update(groups=report, **_summary(report))
                    log(f"{tag}: {ms:.1f} ms ({row['speedup']:.2f}x dense)" + _quality_text(row))
                except Exception as exc:  # keep measuring the other methods
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    log(f"{tag}: FAILED {row['error'][:300]}")
                rows.append(row)
        del ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def kernel_tflops(shape: torch.Size, density: float | None, ms: float, plan_ms: float | None) -> float | None:
    """The call's rate on the pairs it computes exactly: 4 x B x H x S^2 x density x D FLOP over its time
    without its planning (a dense row counts every pair), so a sparse kernel's rate sits beside the dense
    kernels' of the same run (a summary tail's pairs are not counted).

    Args:
        shape: q's [B, H, S, D].
        density: the share of query-key pairs computed exactly (None: not known, no rate).
        ms: the whole call.
        plan_ms: its planning, timed apart (None: none).
    Returns:
        TFLOP/s, or None where the density is unknown or the planning takes the call's whole time.
    """
    B, H, S, D = shape
    kernel_ms = ms - (plan_ms or 0.0)
    if density is None or kernel_ms <= 0:
        return None
    return 4.0 * B * H * S * S * D * density / kernel_ms / 1e9


def _quality_text(row: dict) -> str:
    parts = []
    for key, label in (("density", "density"), ("recall", "recall"), ("rel_l2", "relL2"), ("ctx_rel_l2", "ctx relL2")):
        if row.get(key) is not None:
            parts.append(f"{label} {row[key]:.3f}")
    return (", " + ", ".join(parts)) if parts else ""


def run_preset(name: str, methods: list[str], ratios: list[float], device: torch.device, backend: str = "auto",
               seed: int = 0, scenes: list[str] | None = None, deadline: float | None = None,
               heads: int | None = None) -> dict:
    """Run a named preset; returns {"preset", "environment", "backend", "rows"}.

    `heads`: the preset's geometry with this many heads instead (the scenes cycle through the four head
    kinds, so 4 has one of each): an H3-size preset then also runs on the CPU, its errors per head as at
    56 heads, each method timed once there (no speed claim)."""
    if name not in PRESETS:
        raise SparseAttentionError(f"preset {name!r} is not known: expected one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    size = with_heads(preset.size, heads, "bench")
    if preset.needs_cuda and device.type != "cuda" and heads is None:
        raise SparseAttentionError(f"preset {name!r} needs a CUDA GPU (its scenes are full H3 size; --heads 4 runs its "
                         "geometry with one head of each kind on the CPU)")
    scenes = list(scenes or preset.scenes)
    backend = resolve_kernel(backend, device)
    warmup, reps = (0, 1) if heads is not None and device.type != "cuda" else (preset.warmup, preset.reps)
    rows = run_cases(scene_cases(size, scenes, seed, device), len(scenes), methods, ratios, device, backend,
                     preset.rows_per_group, warmup, reps, seed, deadline)
    return {"preset": name, "size": {"text": size.text, "audio": size.audio, "grid": list(size.grid),
                                     "heads": size.heads, "head_dim": size.head_dim, "tokens": size.total},
            "environment": environment(device), "backend": backend, "seed": seed, "rows": rows}
