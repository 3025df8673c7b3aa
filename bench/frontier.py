"""The speed-up frontier of end-to-end runs: speed-up against `topk_ratio` and against the measured error,
one line per clip (and model depth, preset and GPU), drawn from the JSON that `e2e` writes.

Each input file holds one `e2e` result (`--out`) or a list of them (several commands in one file). A run
of ours counts as a point when it runs the node's warmup as set (`ours`, `ours-ratio-*`); its ratio is the
one in its name, else the command's `--set topk_ratio`, else the node's default. Its speed-up is the clip's
`comfyui` run's seconds over its own, or, for results transcribed from a table that kept only the ratio,
the run's `vs_comfyui`. The error panel is drawn where runs carry `measured_error`.
"""
from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path

POINT_RUNS = re.compile(r"ours(?:-ratio-(\d+(?:\.\d+)?))?")


def default_ratio() -> float:
    """The sparse node's default `topk_ratio`."""
    from ..nodes.widgets import SPARSE_WIDGETS

    return next(w.default for w in SPARSE_WIDGETS if w.name == "topk_ratio")


def results_of(path: str | Path) -> list[dict]:
    """The `e2e` results in a JSON file (one result or a list), or ValueError naming the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"frontier: {path}: not readable as JSON ({err})") from None
    results = data if isinstance(data, list) else [data]
    for i, result in enumerate(results):
        if not isinstance(result, dict) or not isinstance(result.get("runs"), list):
            raise ValueError(f"frontier: {path}: result {i} has no list of runs; expected what `e2e --out` writes")
    return results


def line_label(result: dict, clip: str) -> str:
    """The legend of one line: the clip, the model's depth, the preset and the GPU."""
    blocks = result.get("blocks")
    depth = f"{blocks} blocks" if blocks else "blocks unknown"
    parts = [clip, depth, result.get("preset", "?"), result.get("device", "?")]
    if result.get("optional_packages"):
        parts.append(result["optional_packages"])
    return ", ".join(str(p) for p in parts)


def points(results: list[dict]) -> dict[str, list[tuple[float, float, float | None]]]:
    """{line label: [(ratio, speed-up, measured error or None), ...] sorted by ratio}.

    Raises:
        ValueError: a point run with neither a `comfyui` run of its clip nor a `vs_comfyui`.
    """
    fallback = default_ratio()
    lines: dict[str, list[tuple[float, float, float | None]]] = {}
    for result in results:
        base = {r["clip"]: r["run_s"] for r in result["runs"] if r.get("run") == "comfyui" and r.get("run_s")}
        set_ratio = (result.get("widgets") or {}).get("topk_ratio", fallback)
        for run in result["runs"]:
            match = POINT_RUNS.fullmatch(str(run.get("run", "")))
            if not match:
                continue
            ratio = float(match[1]) if match[1] else float(set_ratio)
            clip = run.get("clip", "?")
            if run.get("run_s") and clip in base:
                speed = base[clip] / run["run_s"]
            elif run.get("vs_comfyui"):
                speed = float(run["vs_comfyui"])
            else:
                raise ValueError(f"frontier: run {run.get('run')!r} of clip {clip!r} has no comfyui run of its "
                                 "clip to compare with and no vs_comfyui")
            lines.setdefault(line_label(result, clip), []).append((ratio, speed, run.get("measured_error")))
    return {label: sorted(pts, key=lambda p: p[0]) for label, pts in lines.items()}


def draw(lines: dict[str, list[tuple[float, float, float | None]]], out: str | Path, title: str = "") -> bool:
    """Write the picture to `out` (PNG): speed-up against ratio, and against the measured error where any
    point has one. Returns whether the error panel was drawn. Needs matplotlib (the `bench` extra)."""
    if not lines:
        raise ValueError("frontier: no runs of ours in the results (expected runs named ours or ours-ratio-*)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_error = any(e is not None for pts in lines.values() for _, _, e in pts)
    fig, axes = plt.subplots(1, 2 if with_error else 1, figsize=(11 if with_error else 6.2, 4.4), squeeze=False)
    ratio_ax = axes[0][0]
    for label, pts in lines.items():
        ratio_ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for ratio, speed, _ in pts:
            ratio_ax.annotate(f"{speed:.2f}x", (ratio, speed), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ratio_ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)  # ComfyUI's own graph
    ratio_ax.set_ylim(bottom=min([0.9] + [speed for pts in lines.values() for _, speed, _ in pts]))
    ratio_ax.set_xlabel("topk_ratio")
    ratio_ax.set_ylabel("speed-up over ComfyUI's own graph (x)")
    ratio_ax.grid(alpha=0.3)
    ratio_ax.legend(fontsize=8)
    if with_error:
        error_ax = axes[0][1]
        for label, pts in lines.items():
            measured = [(e, s) for _, s, e in pts if e is not None]
            error_ax.plot([m[0] for m in measured], [m[1] for m in measured], marker="o", label=label)
        error_ax.set_xlabel("measured error (relative L2 of the video rows, run mean)")
        error_ax.set_ylabel("speed-up (x)")
        error_ax.grid(alpha=0.3)
        error_ax.legend(fontsize=8)
    if title:
        fig.suptitle(textwrap.fill(title, 80), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return with_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="sources", nargs="+", required=True, metavar="JSON",
                        help="e2e result files (what `e2e --out` writes; a file may hold a list of results)")
    parser.add_argument("--out", default="frontier.png", help="the PNG to write (default frontier.png)")
    parser.add_argument("--title", default="", help="a title above the panels")


def run(args: argparse.Namespace) -> int:
    lines = points([r for source in args.sources for r in results_of(source)])
    for label, pts in lines.items():
        print(f"{label}: " + ", ".join(f"ratio {r:g} {s:.2f}x" + (f" (error {e:.4g})" if e is not None else "")
                                       for r, s, e in pts))
    try:
        with_error = draw(lines, args.out, args.title)
    except ImportError:
        print("frontier: matplotlib is not installed (pip install matplotlib, or the package's bench extra)")
        return 2
    print(f"wrote {args.out}" + ("" if with_error else " (speed-up against ratio only: no run has a measured "
                                                        "error)"))
    return 0
