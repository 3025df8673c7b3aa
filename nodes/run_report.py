"""What one run's report says, from its counters (`run_stats.RunStats`): the plain data the report node shows
(`report_of`), the run's log line (`summary_line`) and the attention time its sparse blocks saved (`saved_time`).

The saved time compares what ran with what would have run, attention only: per sparse block call, the
dense attention the node would have run at that shape (its measured dense choice, or ComfyUI's own
attention as launched: `run_timers.ShapeTiming.baseline` names it) against the sparse op (plan and kernel, and the
sampled error rows where measured), both timed on one call per shape and run. Producer and output
projection run either way and are not in it.
"""
from __future__ import annotations

from .run_stats import RunStats


def saved_time(stats: RunStats) -> dict | None:
    """The attention time the run's sparse block calls saved, or None where no call was timed.

    Each shape's saving per block call is (dense ms - sparse ms) / share of its timing; the run's is that
    times the shape's sparse block calls, summed over the timed shapes. Calls of a shape never timed (it
    ran once in the run) are not counted, and counted apart.

    Args:
        stats: the run's counters (`RunStats.timings`, `RunStats.shape_calls`).
    Returns:
        {"saved_s": seconds (negative: time lost), "baseline": the dense attention compared with,
        "untimed_calls": sparse block calls not counted}, or None.
    """
    timed = {key: t for key, t in stats.timings.items() if t.share > 0}
    if not timed:
        return None
    saved_ms = sum(stats.shape_calls.get(key, 0) * (t.dense_ms - t.sparse_ms) / t.share for key, t in timed.items())
    untimed = sum(n for key, n in stats.shape_calls.items() if key not in timed)
    baselines = sorted({t.baseline for t in timed.values()})
    return {"saved_s": saved_ms / 1e3, "baseline": ", ".join(baselines), "untimed_calls": untimed}


def mean_density(stats: RunStats) -> float:
    """Mean density of the sparse block calls (1.0 when none ran sparse)."""
    return stats.density_sum / stats.sparse_blocks if stats.sparse_blocks else 1.0


def summary_line(name: str, s: RunStats, precision: str, plans: dict) -> str | None:
    """One log line of the run's counters, or None when no block ran.

    Args:
        name: the run's owner, as the line starts.
        s: the run's counters.
        precision: the run's arithmetic.
        plans: the kept plans' counts (`PlanStore.summary`).
    """
    if not (s.dense_blocks or s.sparse_blocks):
        return None
    # a step is sparse when any block of it ran sparse
    sparse_steps = len(s.sparse_steps)
    dense_steps = len(s.dense_steps - s.sparse_steps)
    overall = (s.density_sum + s.dense_blocks) / (s.sparse_blocks + s.dense_blocks)
    density = f"{mean_density(s):.3f} in sparse blocks ({overall:.3f} over all blocks)"
    line = (f"{name}: steps {dense_steps} dense / {sparse_steps} sparse; blocks {s.dense_blocks} dense / "
            f"{s.sparse_blocks} sparse; mean density {density}; sparse attention time "
            f"{s.attention_ms / 1e3:.2f} s; precision {precision}")
    saved = saved_time(s)
    if saved is not None:
        line += f"; attention saved {saved['saved_s']:.2f} s against {saved['baseline']}"
    if s.dense_kernels:
        line += "; dense attention on " + ", ".join(sorted(s.dense_kernels))
    if s.sparse_kernels:
        line += "; sparse attention on " + ", ".join(sorted(s.sparse_kernels))
    error = s.errors.summary()
    if error is not None:
        block, value = error["worst_block"]
        line += f"; measured error {error['mean']:.3f} (worst block {block}: {value:.3f})"
    if plans["reused"]:
        past = plans.get("built: memory budget", 0)
        line += (f"; plans reused {plans['reused']}, built {plans['built']} ({plans['rebuilds']} rebuilds"
                 + (f", {past} past the plans' memory budget" if past else "") + ")")
    return line


def report_of(s: RunStats, precision: tuple[str, str], plans: dict) -> dict:
    """What the run did, as plain data (the report node shows it, `report.format_report`), from its counters,
    its precision (arithmetic, why) and its kept plans' counts (`PlanStore.summary`).

    ``saved``: `saved_time` (None where no sparse call was timed). ``attention_s``: the sparse blocks'
    whole attention modules (QKV production, attention, output projection).
    """
    return {"steps_sparse": sorted(s.sparse_steps), "steps_dense": sorted(s.dense_steps - s.sparse_steps),
            "blocks_sparse": s.sparse_blocks, "blocks_dense": s.dense_blocks,
            "layers_sparse": sorted(i for i, (_, n) in s.layers.items() if n),
            "layers_dense_only": sorted(i for i, (_, n) in s.layers.items() if not n),
            "mean_density": mean_density(s), "attention_s": s.attention_ms / 1e3, "saved": saved_time(s),
            "dense_reasons": dict(s.dense_reasons), "precision": precision[0],
            "precision_reason": precision[1], "dense_kernels": dict(s.dense_kernels),
            "sparse_kernels": dict(s.sparse_kernels), "sparse_choices": list(s.sparse_choices),
            "notes": list(s.notes), "plans": plans, "error": s.errors.summary()}
