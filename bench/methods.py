"""The attention methods the benchmark compares, behind one interface.

A method name is a spec string:

- ``dense``: scaled-dot-product attention (cuDNN on CUDA, PyTorch's default on CPU); the
  reference every other method is measured against (the row's `note` names the backend).
- ``dense:<kernel>``: another dense kernel where it is installed (`DENSE_KERNELS`): FlashAttention-4
  (fa4), comfy-kitchen's INT8 attention as ComfyUI's ``--use-ck-attention`` runs it (ck-int8), and
  SageAttention as ``--use-sage-attention`` calls it (sage).
- ``ours:<tiling>:<tail>:<granularity>[:b<block>]``: `sparse_attention` with that SparseConfig
  (tiling cube|reblock, tail none|mean|reweight|coarse, granularity query|block, block size b64 (the
  default) or b128: 128-token query tiles and key blocks); ``*`` in a field expands to every choice.
- ``sol:topk`` / ``sol:tau=<x>``: comfy-kitchen's `sol_attn` (optional dependency) in top-k mode
  at the run's ratios, or in threshold mode at one tau; context rows are its sink blocks/queries.
- ``flex:<tiling>``: PyTorch FlexAttention (CUDA only) over a packed copy of Q/K/V with the
  block table our planner selects for that tiling (no tail); packing is not timed.

A suffix ``@0.1/0.2`` measures a method at those ratios instead of the run's ratios.

`prepare(...)` returns a `Prepared` holding a zero-argument `call` to time and the plan the
quality metrics read (None when the method has no plan of ours).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import SparseAttentionError
from ..backend.attention import sparse_attention
from ..backend.config import BLOCK_SIZES, TAIL_GRANULARITIES, TAILS, TILINGS, SparseConfig
from ..backend.layout import SequenceLayout
from ..backend.planner import build_plan
from ..kernels.flash4 import attention as flash4
from ..kernels.plan import BlockSparsePlan, pack, unpack
from .timing import time_call

DEFAULT_METHOD = "ours:reblock:reweight:query"
DENSE_KERNELS = {  # dense:<name> -> what runs
    "fa4": "FlashAttention-4 (flash_attn.cute)",
    "ck-int8": "comfy-kitchen int8_attention (ComfyUI --use-ck-attention)",
    "sage": "SageAttention sageattn (ComfyUI --use-sage-attention)",
}


@dataclass
class Prepared:
    """A method bound to one input: `call()` is what is timed; `result()` is the output
    [B, H, S, D] in model order."""

    call: Callable[[], torch.Tensor]
    plan: BlockSparsePlan | None = None
    density: float | None = None
    plan_ms: float | None = None
    output: Callable[[], torch.Tensor] | None = None  # when the timed call's result is not in model order
    first: torch.Tensor | None = None  # an output already computed while preparing
    note: str | None = None  # e.g. which SDPA backend dense ran on

    def result(self) -> torch.Tensor:
        """The output in model order (reusing the one computed while preparing, once)."""
        if self.first is not None:
            out, self.first = self.first, None
            return out
        return (self.output or self.call)()


def kitchen_version() -> str:
    """comfy-kitchen's installed version, read from its distribution's metadata as install.py reads it
    (the module has no ``__version__``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("comfy-kitchen")
    except PackageNotFoundError:
        return "(version unknown: no distribution metadata)"


def sol_unavailable_reason() -> str | None:
    """Why comfy-kitchen's `sol_attn` cannot run here (ComfyUI pins releases that predate it), or None."""
    if importlib.util.find_spec("comfy_kitchen") is None:
        return "comfy-kitchen is not installed (pip install comfy-kitchen packaging)"
    import comfy_kitchen

    if not hasattr(comfy_kitchen, "sol_attn"):
        return f"comfy-kitchen {kitchen_version()} has no sol_attn (it came in 0.2.40)"
    return None


def split_spec(spec: str) -> tuple[str, list[float] | None]:
    """``method@0.1/0.2`` -> ("method", [0.1, 0.2]): a method measured at its own ratios only."""
    base, at, tail = spec.partition("@")
    if not at:
        return spec, None
    try:
        ratios = [float(x) for x in tail.split("/")]
    except ValueError:
        raise SparseAttentionError(f"method {spec!r}: ratios after '@' must be numbers separated by '/', e.g. @0.1/0.2") from None
    if not all(0.01 <= r <= 1.0 for r in ratios):
        raise SparseAttentionError(f"method {spec!r}: ratios must be in [0.01, 1]")
    return base, ratios


def expand_methods(specs: list[str]) -> list[str]:
    """Validate method specs and expand ``*`` fields of ``ours:`` specs, keeping the order and any
    ``@ratios`` suffix."""
    out: list[str] = []
    for spec in specs:
        base, fixed = split_spec(spec)
        suffix = spec[len(base):]
        head, _, rest = base.partition(":")
        if head == "ours":
            fields = rest.split(":")
            if len(fields) not in (3, 4):
                raise SparseAttentionError(f"method {spec!r}: expected ours:<tiling>:<tail>:<granularity>[:b<block>]")
            blocks = tuple(f"b{b}" for b in BLOCK_SIZES)
            choices = []
            for value, allowed in zip(fields, (TILINGS, TAILS, TAIL_GRANULARITIES, blocks)):
                if value != "*" and value not in allowed:
                    raise SparseAttentionError(f"method {spec!r}: {value!r} is not one of {', '.join(allowed)}")
                choices.append(allowed if value == "*" else (value,))
            sizes = [""] if len(fields) == 3 else [f":{b}" for b in choices[3]]
            out += [f"ours:{t}:{a}:{g}{b}{suffix}" for t in choices[0] for a in choices[1] for g in choices[2]
                    for b in sizes]
        elif base == "dense" or base == "sol:topk" or (head == "flex" and rest in TILINGS) or (
                head == "dense" and rest in DENSE_KERNELS):
            out.append(spec)
        elif base.startswith("sol:tau="):
            try:
                float(base[len("sol:tau="):])
            except ValueError:
                raise SparseAttentionError(f"method {spec!r}: tau must be a number, e.g. sol:tau=1.0") from None
            out.append(spec)
        else:
            raise SparseAttentionError(f"method {spec!r} is not known: expected dense, dense:<{'|'.join(DENSE_KERNELS)}>, "
                             "ours:<tiling>:<tail>:<granularity>[:b<block>], sol:topk, sol:tau=<x> or "
                             "flex:<cube|reblock>, "
                             "optionally with @ratio/ratio")
    return list(dict.fromkeys(out))


def dense_unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why dense kernel `name` of DENSE_KERNELS cannot run on `device` (bfloat16 inputs), or None."""
    if name == "fa4":
        return flash4.unavailable_reason(torch.empty(0, device=device, dtype=torch.bfloat16))
    if device.type != "cuda":
        return f"{DENSE_KERNELS[name]} needs a CUDA GPU"
    if name == "sage":
        if importlib.util.find_spec("sageattention") is None:
            return "sageattention is not installed (pip install sageattention==1.0.6)"
        return None
    if importlib.util.find_spec("comfy_kitchen") is None:
        return "comfy-kitchen is not installed (pip install comfy-kitchen packaging)"
    import comfy_kitchen

    if not hasattr(comfy_kitchen, "int8_attention"):
        return f"comfy-kitchen {kitchen_version()} has no int8_attention"
    if not comfy_kitchen.int8_attention_is_available():
        return "comfy-kitchen's int8_attention is not available on this GPU or build"
    return None


def dense_kernel(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A call of dense kernel `name` of DENSE_KERNELS on [B, H, S, D] inputs, as ComfyUI's launch runs it."""
    if name == "fa4":
        return lambda: flash4.attention(q, k, v)
    if name == "sage":
        from sageattention import sageattn

        return lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=False)
    import comfy_kitchen

    return lambda: comfy_kitchen.int8_attention(q, k, v)


def unavailable_reason(spec: str, device: torch.device, head_dim: int) -> str | None:
    """Why `spec` cannot run here (missing optional code or hardware), or None."""
    if spec.startswith("dense:"):
        return dense_unavailable_reason(spec[len("dense:"):], device)
    if spec.startswith("sol:"):
        reason = sol_unavailable_reason()
        if reason is not None:
            return reason
        if head_dim != 128:
            return f"comfy-kitchen sol_attn needs head_dim 128, this input has {head_dim}"
    if spec.startswith("flex:") and device.type != "cuda":
        return "FlexAttention is benchmarked on CUDA only"
    return None


def dense_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Callable[[], torch.Tensor], str]:
    """Dense SDPA and the backend it runs on: cuDNN on CUDA when it accepts the input (PyTorch's
    own choice otherwise, named), PyTorch's default on the CPU."""
    import torch.nn.functional as F

    default = (lambda: F.scaled_dot_product_attention(q, k, v)), "sdpa default"
    if not q.is_cuda:
        return default
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)

    try:
        cudnn()
    except RuntimeError:
        return default
    return cudnn, "cudnn"


def ours_config(spec: str, ratio: float, backend: str) -> SparseConfig:
    """The SparseConfig of an ``ours:`` spec at `ratio` on kernel family `backend`."""
    _, tiling, tail, granularity, *block = spec.split(":")
    return SparseConfig(topk_ratio=ratio, tiling=tiling, tail=tail, tail_granularity=granularity,
                        kernel=backend, min_tokens=0, block_size=int(block[0][1:]) if block else 64)


def context_blocks(layout: SequenceLayout, block: int = 64) -> int:
    """64-token blocks (in model order) that cover every row before the target video."""
    return -(-layout.target.start // block)


def prepare(spec: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
            ratio: float | None, backend: str) -> Prepared:
    """Bind method `spec` at `ratio` to the inputs; plans once (outside the timed call for flex)."""
    if spec == "dense":
        call, name = dense_call(q, k, v)
        return Prepared(call, density=1.0, note=name)
    if spec.startswith("dense:"):
        name = spec[len("dense:"):]
        return Prepared(dense_kernel(name, q, k, v), density=1.0, note=DENSE_KERNELS[name])
    if spec.startswith("ours:"):
        config = ours_config(spec, ratio, backend)
        out, info = sparse_attention(q, k, v, layout, config, return_info=True)
        plan_ms = time_call(lambda: build_plan(q, k, v, layout, config), q.device, warmup=0, reps=2)
        return Prepared(lambda: sparse_attention(q, k, v, layout, config), info.plan, info.density, plan_ms,
                        first=out)
    if spec.startswith("sol:"):
        return _prepare_sol(spec, q, k, v, layout, ratio)
    return _prepare_flex(spec, q, k, v, layout, ratio)


def _prepare_sol(spec: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                 ratio: float | None) -> Prepared:
    import comfy_kitchen

    sinks = [0, context_blocks(layout)]
    if spec == "sol:topk":
        kwargs = {"topk_ratio": float(ratio)}
    else:
        kwargs = {"tau": float(spec[len("sol:tau="):])}
    # sol_attn takes (B, T, H, D); a transposed view of [B, H, S, D] is accepted as is
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return Prepared(lambda: comfy_kitchen.sol_attn(qt, kt, vt, sink_blocks=sinks, sink_q=sinks, **kwargs).transpose(1, 2))


def flex_block_mask(plan: BlockSparsePlan):
    """A FlexAttention BlockMask with exactly the plan's exact key blocks, padding keys masked."""
    from torch.nn.attention.flex_attention import BlockMask

    bs, J = plan.block_size, plan.num_blocks
    allowed = plan.allowed_mask()
    whole = (plan.block_len == bs).view(1, 1, 1, J)

    def table(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices
        return mask.sum(-1, dtype=torch.int32), order.to(torch.int32).contiguous()

    valid_key = (torch.arange(bs, device=allowed.device).view(1, bs) < plan.block_len.view(J, 1)).reshape(-1)

    def key_is_valid(b, h, q_idx, kv_idx):
        return valid_key[kv_idx]

    partial_num, partial_idx = table(allowed & ~whole)
    full_num, full_idx = table(allowed & whole)
    return BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=bs,
                                    mask_mod=key_is_valid, seq_lengths=(J * bs, J * bs))


_compiled_flex = None
FLEX_TILES = {"BLOCK_M": 64, "BLOCK_N": 64}  # kernel tiles that divide our 64-token blocks


def _prepare_flex(spec: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                  ratio: float | None) -> Prepared:
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    fn = _compiled_flex
    config = SparseConfig(topk_ratio=ratio, tiling=spec.split(":")[1], tail="none", min_tokens=0)
    plan = build_plan(q, k, v, layout, config)
    kp = plan
    block_mask = flex_block_mask(kp)
    qt, kt, vt = pack(q, kp.q_perm), pack(k, kp.k_perm), pack(v, kp.k_perm)
    call = lambda: fn(qt, kt, vt, block_mask=block_mask, kernel_options=FLEX_TILES)  # noqa: E731
    return Prepared(call, kp, plan.density(), output=lambda: unpack(call(), kp.q_perm, q.shape[2]))
