"""The public entry point: `sparse_attention(q, k, v, layout, config)`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ..errors import SparseAttentionError
from ..kernels.plan import BlockSparsePlan
from ..kernels.registry import Kernels
from .config import SparseConfig
from .fidelity import SampledError, sampled_error
from .layout import SequenceLayout
from .plan_reuse import PlanSlot
from .planner import build_plan, call_kernels
from .tail import coarse_branch

if TYPE_CHECKING:  # imported when a call runs: its decorators import torch._dynamo (and with it Triton)
    from ..kernels.sparse_choice.choice import SparseChoices

HEAD_DIMS = (32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class SparseInfo:
    """What a call computed: exact-pair density, per-region budgets, the attention kernel that ran (a family,
    or under ``auto`` the measured choice's `SPARSE_KERNELS` name), the plan, optional timings, and with
    ``measure_error`` the sampled estimate of the call's error (`backend/fidelity.py`):

    - sampled_error: relative L2 of the output against dense attention on the sampled video rows, pooled
      over heads and batch (None with ``measure_error`` off);
    - sampled_error_heads: the same per head, [H] on the device (None with ``measure_error`` off).
    """

    density: float
    budgets: dict[str, int]
    kernel: str
    plan: BlockSparsePlan
    timings_ms: dict[str, float] = field(default_factory=dict)
    sampled_error: float | None = None
    sampled_error_heads: torch.Tensor | None = None


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                 config: SparseConfig | None = None, coarse_gate: torch.Tensor | None = None) -> None:
    """Raise TypeError (wrong kind of object) or ValueError (wrong shape, dtype, device) naming the
    offending argument and its value when `sparse_attention` cannot run on these inputs.

    Everything is decided from metadata: nothing is computed, copied or synchronised.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"sparse_attention: {name} must be a torch.Tensor [B, H, S, D], got {type(t).__name__}")
    if not isinstance(layout, SequenceLayout):
        raise TypeError(f"sparse_attention: layout must be a SequenceLayout (SequenceLayout.from_segments(...)), "
                        f"got {type(layout).__name__}")
    if config is not None and not isinstance(config, SparseConfig):
        raise TypeError(f"sparse_attention: config must be a SparseConfig or None (SparseConfig(**values) for a "
                        f"dict), got {type(config).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise SparseAttentionError(f"sparse_attention: {name} must be [B, H, S, D], got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise SparseAttentionError(f"sparse_attention: {name}.dtype={t.dtype} is not supported: expected one of "
                             f"{', '.join(str(d) for d in DTYPES)}")
    if not (q.shape == k.shape == v.shape):
        raise SparseAttentionError(f"sparse_attention: q, k, v must have the same shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise SparseAttentionError(f"sparse_attention: q, k, v must share one dtype and one device, got q {_describe(q)}, "
                         f"k {_describe(k)}, v {_describe(v)}")
    if q.shape[-1] not in HEAD_DIMS:
        raise SparseAttentionError(f"sparse_attention: head_dim={q.shape[-1]} is not supported: expected one of {HEAD_DIMS}")
    if q.shape[2] != layout.total:
        raise SparseAttentionError(f"sparse_attention: sequence length {q.shape[2]} does not match the layout's "
                         f"{layout.total} rows ({layout!r})")
    if coarse_gate is not None:
        check_gate(coarse_gate, q)


def check_gate(gate: torch.Tensor, q: torch.Tensor) -> None:
    """Raise unless the coarse gate is a floating tensor on q's device that broadcasts to q's shape
    [B, H, S, D] without changing it (e.g. [H, 1, 1])."""
    if not isinstance(gate, torch.Tensor):
        raise TypeError(f"sparse_attention: coarse_gate must be a torch.Tensor broadcastable to {tuple(q.shape)}, "
                        f"got {type(gate).__name__}")
    fits = gate.dim() <= q.dim() and all(g in (1, n) for g, n in zip(reversed(gate.shape), reversed(q.shape)))
    if not fits or not gate.is_floating_point() or gate.device != q.device:
        raise SparseAttentionError(f"sparse_attention: coarse_gate {_describe(gate)} is not allowed: expected a floating tensor on "
                         f"{q.device} broadcastable to the output {tuple(q.shape)} (e.g. [H, 1, 1])")


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                     config: SparseConfig | None = None, *, return_info: bool = False,
                     coarse_gate: torch.Tensor | None = None, timings: bool = False,
                     choices: SparseChoices | None = None, ran: Callable[[str, str], None] | None = None,
                     plan_slot: PlanSlot | None = None, error_rotation: int = 0,
                     error_sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None):
    """Adaptive block-sparse attention of q, k, v [B, H, S, D] in the model's token order.

    Plans the call (tiling, routing, tail summaries) and runs the block-sparse kernel on it; every
    stage of the call runs the implementation the table gives it for `config.kernel` (`kernels/registry.py`).
    Bad inputs raise before anything is computed (`check_inputs`).

    Args:
        q, k, v: one dtype and device, head_dim in HEAD_DIMS, S = layout.total.
        layout: the segments of the packed sequence.
        config: the engine's settings (default `SparseConfig()`).
        return_info: also return a `SparseInfo` (reading its density and sampled error synchronises once).
        coarse_gate: broadcastable to the output (e.g. [H, 1, 1]); scales the coarse branch of
            ``tail="coarse"``. Without it there is no coarse term, as for a model without gates.
        timings: synchronise the device to report plan and kernel milliseconds in the info.
        choices: the measured sparse-kernel choices ``kernel="auto"`` runs (`attend`); None: the
            layout's own, kept in memory only.
        ran: receives, per call, the report's name of the attention kernel that ran and the measured
            choice's summary ("" where nothing was measured).
        plan_slot: the plan kept from this block's last evaluated step, reused where its rule
            allows (`plan_reuse.PlanSlot`; ``plan_reuse`` on or auto in the node).
        error_rotation: which query blocks the error measurement samples (`fidelity.sample_rows`): pass
            the denoising step or a call counter, so a run's calls see every part of the clip.
        error_sink: with ``config.measure_error``, receives the call's per-head sums on the device,
            (sum |out - exact|^2 [H], sum |exact|^2 [H]) over the sampled video rows, to be added up
            without a host synchronisation (the relative L2 is sqrt(sum of the first / sum of the second)).
    The sampled rows run only with ``config.measure_error`` on and a reader (`return_info` or `error_sink`);
    with it off nothing extra runs and the info's sampled_error fields are None.
    Returns:
        The output [B, H, S, D] (same order and dtype as q), and the info with `return_info`.
    """
    config = SparseConfig() if config is None else config
    check_inputs(q, k, v, layout, config, coarse_gate)
    kernels = call_kernels(q, layout, config)
    marks = [_now(q, timings)]  # 0.0 without timings: nothing for torch.compile to break on
    plan = build_plan(q, k, v, layout, config, kernels=kernels, slot=plan_slot)
    marks.append(_now(q, timings))
    out, ran_on = attend(q, k, v, plan, layout, config, kernels, choices, ran)
    if config.tail == "coarse" and coarse_gate is not None:
        out = out + coarse_gate.to(out.dtype) * coarse_branch(q, k, v, plan, config.tail_granularity, kernels)
    marks.append(_now(q, timings))
    sample = None
    if config.measure_error and (return_info or error_sink is not None):
        sample = measure(q, k, v, out, layout, config, error_rotation, error_sink)
        marks.append(_now(q, timings))
    if not return_info:
        return out
    budgets = {f"{seg.kind}[{seg.start}:{seg.stop}]": g.budget
               for seg, span in zip(plan.tiling.regions, plan.tiling.region_blocks)
               for g in plan.groups if (g.lo, g.hi) == span}
    info = SparseInfo(plan.density(), budgets, ran_on, plan)
    if sample is not None:
        info.sampled_error, info.sampled_error_heads = float(sample.pooled().detach()), sample.heads().detach()
    if timings:
        info.timings_ms = {"plan": (marks[1] - marks[0]) * 1e3, "kernel": (marks[2] - marks[1]) * 1e3}
        if sample is not None:
            info.timings_ms["error"] = (marks[3] - marks[2]) * 1e3
    return out, info


def measure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layout: SequenceLayout,
            config: SparseConfig, rotation: int, sink: Callable[[torch.Tensor, torch.Tensor], None] | None
            ) -> SampledError:
    """The call's sampled error (`fidelity.sampled_error` on the config's sparse regions), handed to `sink`
    as (sum diff^2 [H], sum exact^2 [H]) when given."""
    sample = sampled_error(q, k, v, out, layout, rotation, config.sparse_scope)
    if sink is not None:
        sink(sample.sq_diff, sample.sq_exact)
    return sample


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan, layout: SequenceLayout,
           config: SparseConfig, kernels: Kernels, choices: SparseChoices | None = None,
           ran: Callable[[str, str], None] | None = None) -> tuple[torch.Tensor, str]:
    """The attention of a planned call: under ``kernel="auto"`` the measured sparse choice within the run's
    precision bound (`SparseChoices.attend`; `choices` None: the layout's own), else the named family.

    Returns:
        (out [B, H, S, D] in q's dtype, the kernel that ran).
    """
    from ..kernels.sparse_choice.choice import SparseChoices, label

    if config.kernel != "auto":
        out, _ = kernels.attention.attend_blocks(q, k, v, plan, precision=config.exact_precision)
        name, summary = kernels.family, ""
    else:
        if choices is None:
            choices = layout.cache.get("sparse_choices", (), lambda: SparseChoices(persist=False))
        out, _, name, summary = choices.attend(q, k, v, plan, config.exact_precision,
                                               (kernels.family, kernels.attention), config.strict,
                                               layout.cache.notices, ratio=config.topk_ratio)
    if ran is not None:
        ran(label(name, config.exact_precision), summary)
    return out, name


def _now(x: torch.Tensor, timed: bool) -> float:
    """The host clock after the device's queued work when `timed`; 0.0 otherwise (reading the
    clock in every call would break a torch.compile graph and guard on the value)."""
    if not timed:
        return 0.0
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter()
