"""The text of the "Sparse Attention Report" node, from `run_report.report_of` data (no ComfyUI)."""
from __future__ import annotations

from .error_meter import SCALE


def spans(values: list[int]) -> str:
    """Compact 0-based index list: [0, 1, 2, 5] -> '0-2, 5'."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ", ".join(out) or "none"


def saving(saved: dict | None) -> str:
    """The attention time saved (`run_report.saved_time`), or plainly the time lost when sparse attention was the
    slower one, naming the dense attention it was compared with."""
    if saved is None:
        return "attention time saved: not measured (no block ran sparse twice with one shape)"
    seconds, baseline = saved["saved_s"], saved["baseline"]
    if seconds < 0:
        text = (f"attention time lost: {-seconds:.2f} s (sparse attention was SLOWER than {baseline}, the dense "
                "attention these blocks would have run, timed on one call per shape)")
    else:
        text = (f"attention time saved: {seconds:.2f} s (sparse attention against {baseline}, the dense attention "
                "these blocks would have run, timed on one call per shape)")
    if saved["untimed_calls"]:
        text += f"; {saved['untimed_calls']} sparse block calls of shapes that ran once are not counted"
    return text


def format_report(report: dict | None) -> str:
    """Several lines: steps and blocks that ran sparse, density, time, and why blocks ran dense.

    Args:
        report: a `run_report.report_of` dict, or None when no run finished yet.
    Returns:
        The text the node shows.
    """
    if report is None:
        return "No sampling run with this model has finished yet."
    steps = [s for s in report["steps_sparse"] if s >= 0]
    lines = [
        f"Sparse steps (0-based): {spans(steps)}; dense-only steps: {spans([s for s in report['steps_dense'] if s >= 0])}",
        f"Block calls: {report['blocks_sparse']} sparse, {report['blocks_dense']} dense; "
        f"layers that ran sparse: {spans(report['layers_sparse'])}; layers always dense: "
        f"{spans(report['layers_dense_only'])}",
        f"Mean density of sparse blocks: {report['mean_density']:.3f}",
        f"Sparse attention time: {report['attention_s']:.2f} s; " + saving(report["saved"]),
    ]
    if "precision" in report:
        lines.append(f"Precision: {report['precision']} ({report['precision_reason']})")
    if report.get("dense_kernels"):
        lines.append("Dense attention (our override) ran on: " + "; ".join(
            f"{name} ({n} calls)" for name, n in sorted(report["dense_kernels"].items())))
    if report.get("sparse_kernels"):
        lines.append("Sparse attention ran on: " + "; ".join(
            f"{name} ({n} calls)" for name, n in sorted(report["sparse_kernels"].items())))
    lines += [f"Sparse kernel choice: {summary}" for summary in report.get("sparse_choices", [])]
    lines += error_lines(report.get("error"))
    plans = report.get("plans") or {}
    if plans.get("reused"):
        lines.append(f"Plans reused across steps: {plans['reused']}; built {plans['built']}, of which "
                     f"{plans['rebuilds']} rebuilds (" + ", ".join(
                         f"{why.removeprefix('built: ')} {n}" for why, n in plans.items() if why.startswith("built: "))
                     + ")")
    if report["blocks_sparse"] == 0:
        lines.insert(0, "The sparse path did not run in this sampling run.")
    lines += [f"Note: {note}" for note in report.get("notes", ())]
    if report["dense_reasons"]:
        lines.append("Why blocks ran dense:")
        lines += [f"- {reason}: {n} block calls" for reason, n in sorted(report["dense_reasons"].items())]
    return "\n".join(lines)


def error_lines(error: dict | None) -> list[str]:
    """The run's measured error (`ErrorMeter.summary`), or nothing where it was not measured."""
    if error is None:
        return []
    block, value = error["worst_block"]
    hb, head, worst = error["worst_head"]
    steps = ", ".join(f"{s}: {e:.3f}" for s, e in sorted(error["steps"].items()))
    return [f"Measured error (relative L2 of video rows against dense attention, on sampled exact rows): run mean "
            f"{error['mean']:.3f}; worst block {block} ({value:.3f}); worst head {head} of block {hb} ({worst:.3f}); "
            f"per step: {steps}", f"  ({SCALE})"]
