"""One sparse block call: whether the engine can take it, Q/K/V per head group, the engine's attention
(`sparse_attention`), the output projection, and what the run report measures of it."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..backend.attention import DTYPES, HEAD_DIMS, sparse_attention
from ..backend.config import SparseConfig
from ..backend.layout import SequenceLayout
from ..backend.plan_reuse import PlanSlot
from ..backend.planner import layout_kernels
from ..backend.producer import produce_qkv
from ..kernels.sparse_choice.choice import SparseChoices
from .comfy_weights import head_groups, on_device, outside_allocation_graph, qkv_projection, unwrap_input
from .run_tracker import RunTracker

DEVICES = ("cuda", "cpu")


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
           attn: torch.nn.Module, x: Any, rope_freqs: Any, transformer_options: dict) -> torch.Tensor:
    """Sparse attention of block input x, then out_proj (`output`). The first call of a layout in a run
    measures the density, the second is timed against dense attention for the report; with ``measure_error``
    every call adds its sampled error to the run's `ErrorMeter`, on the device.

    Args:
        tracker: the run's tracker (densities, timings, kept plans, counters).
        choices: the measured sparse-kernel choices (``kernel="auto"``).
        setting: the node's config (the coarse gate follows its tail).
        layer: the block index.
        token: what the hook's `decide` returned: (step, layout, engine config, branch, (sigma, next sigma)).
        attn, x, rope_freqs, transformer_options: the block's attention module and its call.
    Returns:
        The attention output [S, hidden].
    """
    step, layout, config, branch, sigmas = token
    timer = tracker.start_timer(x[0] if isinstance(x, list) else x)
    key = (layout.signature(), config.topk_ratio)
    density = tracker.densities.get(key)
    timed = key in tracker.timed
    group = 0  # the head group of the next `run` (its plan slot)
    kernel = dict(choices=choices, ran=tracker.note_sparse_kernel, error_rotation=(step or 0) + layer)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, h0: int) -> torch.Tensor:
        nonlocal density, group
        slot = None if config.plan_reuse != "on" else tracker.plans.slot((branch, layer, layout.signature(), group))
        if slot is not None:
            slot.at(*sigmas)
        group += 1
        kernel["error_sink"] = tracker.stats.errors.sink(step, layer, h0, attn.heads, config.topk_ratio)
        if density is None:  # measured once per shape, density and run: it needs a host sync
            o, info = sparse_attention(q, k, v, layout, config, return_info=True, coarse_gate=g, plan_slot=slot,
                                       **kernel)
            density = tracker.densities.setdefault(key, info.density)
        elif not timed:  # the next call (kernels prepared): vs dense
            o, sparse_ms, dense_ms = timed_against_dense(q, k, v, layout, config, g, slot, **kernel)
            tracker.note_timing(key, sparse_ms, dense_ms)
        else:
            o = sparse_attention(q, k, v, layout, config, coarse_gate=g, plan_slot=slot, **kernel)
        return o

    out = output(attn, x, rope_freqs, transformer_options, run, layout, config, setting)
    tracker.stop_timer(timer)
    tracker.note_block(step, sparse=True, density=density, layer=layer)
    return out


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


def timed_against_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                        config: SparseConfig, gate: torch.Tensor | None, slot: PlanSlot | None = None,
                        **kernel: Any) -> tuple[torch.Tensor, float, float]:
    """One sparse call timed against torch's dense SDPA on the same tensors (for the run report).

    Dense attention runs on the first head only and is scaled by the number of heads, to keep the
    extra cost to one head's attention. Synchronises the device three times. `kernel`: `sparse_attention`'s
    ``choices`` and ``ran``.
    Returns (sparse output, sparse ms, dense ms for all heads of q).
    """
    def now() -> float:
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
        return time.perf_counter()

    t0 = now()
    out = sparse_attention(q, k, v, layout, config, coarse_gate=gate, plan_slot=slot, **kernel)
    t1 = now()
    torch.nn.functional.scaled_dot_product_attention(q[:, :1], k[:, :1], v[:, :1])
    t2 = now()
    return out, (t1 - t0) * 1e3, (t2 - t1) * 1e3 * q.shape[1]


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
