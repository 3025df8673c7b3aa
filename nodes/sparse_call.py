"""One sparse block call: whether the engine can take it, Q/K/V per head group, the engine's attention
(`sparse_attention`), the output projection, and what the run report measures of it."""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..backend.attention import DTYPES, HEAD_DIMS, sparse_attention
from ..backend.config import SparseConfig
from ..backend.layout import SequenceLayout
from ..backend.plan_reuse import PlanSlot
from ..backend.planner import layout_kernels
from ..backend.producer import produce_qkv
from ..kernels.sparse_choice.choice import SparseChoices, ratio_class
from .comfy_weights import head_groups, on_device, outside_allocation_graph, qkv_projection, unwrap_input
from .run_timers import mark
from .run_tracker import RunTracker

DEVICES = ("cuda", "cpu")
# q, k, v [B, H, S, D] -> (a thunk running the dense attention a dense block would run on them, its name)
DenseBaseline = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[Callable[[], torch.Tensor], str]]


def call_problem(attn: torch.nn.Module, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 layout: SequenceLayout | None) -> str | None:
    """Why a block call with input of this shape (rows, hidden), dtype and device cannot run sparse, or None."""
    if layout is None:
        return ("the packed-sequence layout was not found (no args['layout'], "
                "transformer_options['minimax_h3_layout'] or minimax_payload layout)")
    if len(shape) != 2 or shape[0] != layout.total:
        return f"block input of shape {tuple(shape)} does not match the layout's {layout.total} rows"
    if attn.head_dim not in HEAD_DIMS:
        return f"head_dim={attn.head_dim} is not supported (expected one of {HEAD_DIMS})"
    if dtype not in DTYPES:
        return f"dtype {dtype} is not supported (expected one of {', '.join(str(d) for d in DTYPES)})"
    if device.type not in DEVICES:
        return f"device {device} is not supported (expected one of {', '.join(DEVICES)})"
    return None


def attend(tracker: RunTracker, choices: SparseChoices, setting: SparseConfig, layer: int, token: Any,
           attn: torch.nn.Module, x: Any, rope_freqs: Any, transformer_options: dict,
           dense: DenseBaseline) -> torch.Tensor:
    """Sparse attention of block input x, then out_proj (`output`). The first call of a layout and ratio class
    (`sparse_choice.choice.ratio_class`: the classes the kernel choice is keyed by) in a run measures the density,
    the next head groups of that shape are timed against the dense attention that would have run
    (`timed_against_dense`) for the report's saved time; the other ratios of that class (an error target's, a
    ramp's) take those figures, so they cost no host synchronisation. With ``measure_error`` every call adds its
    sampled error to the run's `ErrorMeter`, on the device.

    Args:
        tracker: the run's tracker (densities, timings, kept plans, counters).
        choices: the measured sparse-kernel choices (``kernel="auto"``).
        setting: the node's config (the coarse gate follows its tail).
        layer: the block index.
        token: what the hook's `decide` returned: (step, layout, engine config, branch, (sigma, next sigma)).
        attn, x, rope_freqs, transformer_options: the block's attention module and its call.
        dense: the dense attention a dense block would run (the timed call's baseline).
    Returns:
        The attention output [S, hidden].
    """
    step, layout, config, branch, sigmas = token
    timer = tracker.start_timer(x[0] if isinstance(x, list) else x)
    key = (layout.signature(), ratio_class(config.topk_ratio))  # a new ratio of a class met already: no host sync
    density = tracker.densities.get(key)
    timed = key in tracker.timed
    group = 0  # the head group of the next `run` (its plan slot)
    kernel = dict(choices=choices, ran=tracker.note_sparse_kernel, error_rotation=(step or 0) + layer)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, h0: int) -> torch.Tensor:
        nonlocal density, group
        where = (branch, layer, layout.signature(), group)
        slot, undecided = plan_slot(tracker, config, where)
        if slot is not None:
            slot.at(*sigmas)
        group += 1
        kernel["error_sink"] = tracker.stats.errors.sink(step, layer, h0, attn.heads, config.topk_ratio)
        if density is None:  # measured once per shape, density and run: it needs a host sync
            o, info = sparse_attention(q, k, v, layout, config, return_info=True, coarse_gate=g, plan_slot=slot,
                                       **kernel)
            density = tracker.densities.setdefault(key, info.density)
        elif not timed:  # the next head groups (kernels prepared): against the dense attention
            o = timed_against_dense(tracker, key, q.shape[1] / attn.heads, q, k, v, dense, lambda: sparse_attention(
                q, k, v, layout, config, coarse_gate=g, plan_slot=slot, **kernel))
        else:
            o = sparse_attention(q, k, v, layout, config, coarse_gate=g, plan_slot=slot, **kernel)
        if undecided:  # the shape's first plan is built and measured: auto decides for the run
            notice = tracker.plans.decide(where[2], where, slot, q.device, f"{layout.total}-row")
            if notice is not None:
                tracker.say_in_report(notice, logging.INFO)
        return o

    out = output(attn, x, rope_freqs, transformer_options, run, layout, config, setting)
    tracker.stop_timer(timer)
    tracker.note_block(step, sparse=True, density=density, layer=layer, shape=key)
    return out


def plan_slot(tracker: RunTracker, config: SparseConfig, where: tuple) -> tuple[PlanSlot | None, bool]:
    """The slot a head group's plan is kept in (None: planned afresh) and whether `plan_reuse="auto"` decides
    for the shape after this call (its first this run: `PlanStore.decide`).

    Args:
        tracker: the run's tracker (its `PlanStore`).
        config: the call's engine config (``plan_reuse``).
        where: the slot's key (branch, block, layout signature, head group).
    """
    if config.plan_reuse == "off":
        return None, False
    verdict = None if config.plan_reuse == "on" else tracker.plans.verdict(where[2])
    if verdict is False:
        return None, False
    return tracker.plans.slot(where), config.plan_reuse == "auto" and verdict is None


def output(attn: torch.nn.Module, x: Any, rope_freqs: Any, transformer_options: dict,
           run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor],
           layout: SequenceLayout, config: SparseConfig, setting: SparseConfig) -> torch.Tensor:
    """The attention output [S, hidden] of block input x (or KJNodes' one-item list, freed early): Q/K/V per
    head group (``minimax_head_chunks``, the epilogue the layout's kernels give), `run(q, k, v, gate, first head)`
    -> [1, h, S, D] on each, then out_proj."""
    x = unwrap_input(x)
    heads, dim = attn.heads, attn.head_dim
    norm_rope = layout_kernels(layout, config, x.device, x.dtype, dim).norm_rope
    with outside_allocation_graph():
        out = x.new_empty(x.shape[0], heads, dim)
        gate = coarse_gate(attn, x, setting)
        with qkv_projection(attn.qkv_proj, x, heads, dim) as projection:
            qw, kw = on_device(attn.q_norm.weight, x.device), on_device(attn.k_norm.weight, x.device)
            for h0, h1 in head_groups(heads, transformer_options.get("minimax_head_chunks", 1)):
                q, k, v = produce_qkv(x, projection, None, heads, dim, qw, kw, attn.q_norm.eps, rope_freqs,
                                      (h0, h1), norm_rope=norm_rope)
                g = None if gate is None else gate[:, h0:h1]
                o = run(q, k, v, g, h0)
                out[:, h0:h1] = o[0].transpose(0, 1)
                del q, k, v, o, g
        del x, gate
    return attn.out_proj(out.view(out.shape[0], heads * dim))


def coarse_gate(attn: torch.nn.Module, x: torch.Tensor, config: SparseConfig) -> torch.Tensor | None:
    """The learned gate of the coarse branch for block input x, [1, H, S, D], or None.

    Blocks of distilled FastH3 (VSA) checkpoints carry ``attn.to_gate_compress``, a bias-free
    Linear(hidden, H * D) of the attention input; the attention output is then
    O_sparse + g * C with C the coarse branch. Only ``tail="coarse"`` uses it.
    """
    layer = getattr(attn, "to_gate_compress", None)
    if config.tail != "coarse" or layer is None:
        return None
    g = layer(x)  # the layer's own forward: any op class (GGUF, quantised, LoRA) computes it as the model does
    return g.view(x.shape[0], attn.heads, attn.head_dim).transpose(0, 1).unsqueeze(0)


def timed_against_dense(tracker: RunTracker, key: tuple, share: float, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, dense: DenseBaseline, sparse: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The sparse op `sparse()` (plan and kernel) of one head group, timed against the dense attention a dense
    block would run on the same q, k, v, for the report's saved time (`run_report.saved_time`).

    The dense choice is resolved before the timing (its first use of a bucket measures); the marks are CUDA
    events read at the model call's end, so nothing here waits for the device.

    Args:
        tracker: the run's tracker (it keeps the timing under `key`).
        key: the call's timing key (layout signature, ratio).
        share: the head group's share of the call's heads.
        q, k, v: the head group's [1, h, S, D].
        dense: the dense baseline (`DenseBaseline`).
        sparse: runs the sparse op.
    Returns:
        The sparse output.
    """
    run_dense, baseline = dense(q, k, v)
    start = mark(q)
    out = sparse()
    middle = mark(q)
    run_dense()
    tracker.note_timing(key, share, baseline, (start, middle, mark(q)))
    return out


def gate_notice(diffusion_model: Any, config: SparseConfig) -> str | None:
    """What tail="coarse" does on this model, when that is not the model's own gated coarse term."""
    if config.tail != "coarse":
        return None
    gated = sum(getattr(b.attn, "to_gate_compress", None) is not None for b in diffusion_model.blocks)
    if gated == 0:
        return ("tail='coarse': the model's blocks have no to_gate_compress gate (only distilled FastH3 checkpoints "
                "carry one), so the coarse term is zero and unselected blocks get no stand-in, as with tail='none'")
    if gated < len(diffusion_model.blocks):
        return (f"tail='coarse': {len(diffusion_model.blocks) - gated} of {len(diffusion_model.blocks)} blocks have "
                "no to_gate_compress gate; their coarse term is zero")
    if config.tail_granularity == "query":
        return ("tail='coarse' with tail_granularity='query' scores the coarse branch per query; the gate was trained "
                "with the block-broadcast term (tail_granularity='block')")
    return None
