"""The attention override of the blocks the sparse node runs dense: the fastest kernel within the precision."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..backend.attention import DTYPES
from ..kernels.dense.choice import DenseChoices, HostAttention, sdpa
from .precision import identity, is_eight_bit

MAX_FUNCTIONS = 16  # identities of ComfyUI attention functions remembered (a launch has one or two)


class DenseOverride:
    """``optimized_attention_override`` of the blocks our node runs dense.

    ComfyUI calls it with its own attention function (`func`: the one its launch flags bound, or
    another node's patch of it) and that function's arguments. `func` is itself a candidate of the
    measured choice (`DenseChoices`), beside SDPA's kernels and FlashAttention-4, so a steady dense step
    is not slower than ComfyUI's own; an 8-bit `func` is a candidate of 8-bit runs only. It is called
    with the arguments ComfyUI passed (``transformer_options``, ``_inside_attn_wrapper`` kept: a
    function that falls back to another wrapped ComfyUI attention would otherwise reach this override
    again). A call it does not serve (a mask, another attention precision or scale, grouped heads, a
    dtype the engine does not take) goes to `func` unchanged. Where the user chose the model's
    attention with ComfyUI's ModelAttentionBackend, that choice (`chosen`) stands in for `func`
    everywhere, as it does without our node: the override it replaces called it instead of `func`.
    Where a block's attention module chose its own function (current upstream's ``attn.comfy_attention``),
    the block's calls get `preferring` it: that function stands in for `func` (below `chosen`, as in ComfyUI).

    Runs eagerly under torch.compile: it reads the run's precision and records the kernel in the run
    report, state a compiled frame would freeze (TorchCompileModel drops the guards under
    ``transformer_options``, where ComfyUI finds this object); what it runs is one attention call.

    Each patched model's state holds its own (`SparseAttentionHook.start_state`); the measured kernel
    choices it reads (`choices`) are shared by the clones of one node's model, as they are facts of
    the machine.

    Args:
        choices: the measured dense-kernel choices.
        ran: receives, per call, the name of the kernel that ran (for the run report).
        precision: "bf16" or "8-bit", the bound the candidates must meet (set per run by the hook).
        chosen: the attention function chosen for the model (`precision.model_choice`), or None for
            ComfyUI's own (set per run by the hook).
    """

    def __init__(self, choices: DenseChoices, ran: Callable[[str], None] = lambda name: None,
                 precision: str = "bf16", chosen: Callable | None = None):
        self.choices = choices
        self.ran = ran
        self.precision = precision
        self.chosen = chosen
        self.identities: dict[Callable, str] = {}
        self.preferred: dict[Callable, PreferredOverride] = {}

    def preferring(self, function: Callable | None) -> DenseOverride | PreferredOverride:
        """The override of a block whose attention module chose `function` (`precision.module_attention`;
        None: this override). One object per function (at most MAX_FUNCTIONS kept), so compiled callers
        see the same object every call."""
        if function is None:
            return self
        bound = self.preferred.get(function)
        if bound is None:
            bound = PreferredOverride(self, function)
            if len(self.preferred) < MAX_FUNCTIONS:
                self.preferred[function] = bound
        return bound

    def host(self, func: Callable, heads: int, kwargs: dict) -> HostAttention:
        """ComfyUI's `func` as a candidate: [B, H, S, D] in and out, with ComfyUI's other arguments."""
        ident = self.identities.get(func)
        if ident is None:
            ident = identity(func)
            if len(self.identities) < MAX_FUNCTIONS:
                self.identities[func] = ident

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return func(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=True, skip_output_reshape=True,
                        **kwargs)

        return HostAttention(ident, run, is_eight_bit(ident), label=f"ComfyUI's attention {ident}")

    def baseline(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, func: Callable | None,
                 fastest: bool = True) -> tuple[Callable[[], torch.Tensor], str]:
        """The dense attention a dense block would run on q, k, v [B, H, S, D] (the saved time's baseline in the
        run report), its kernel choice resolved now (a bucket's first use measures), and its name.

        Args:
            q, k, v: a sparse call's head group.
            func: ComfyUI's attention function as launched (`precision.launch_attention`); None where not found.
            fastest: ``dense_attention="fastest"``: this override runs the dense blocks; False: ComfyUI's own
                attention (ModelAttentionBackend's choice where set) runs them.
        Returns:
            (a thunk that runs it and returns its output, its name).
        """
        func = func if self.chosen is None else self.chosen
        host = None if func is None else self.host(func, q.shape[1], {})
        if not fastest:
            if host is not None:
                return (lambda: host.run(q, k, v)), host.name()
            return (lambda: sdpa(q, k, v, None)), self.choices.label(None)
        kernel = self.choices.choice(q, k, v, host, self.precision)
        return (lambda: self.choices.attention(q, k, v, host, self.precision)[0]), self.choices.label(kernel, host)

    @torch.compiler.disable
    def __call__(self, func: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                 mask: Any = None, attn_precision: Any = None, skip_reshape: bool = False,
                 skip_output_reshape: bool = False, **kwargs: Any) -> torch.Tensor:
        func = func if self.chosen is None else self.chosen
        if (mask is not None or attn_precision is not None or kwargs.get("enable_gqa")
                or kwargs.get("scale") is not None or q.dtype not in DTYPES):
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)
        if not skip_reshape:  # [B, S, H * D] -> [B, H, S, D]
            q, k, v = (t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
        host = self.host(func, heads, kwargs)
        out, kernel = self.choices.attention(q, k, v, host, self.precision)
        self.ran(self.choices.label(kernel, host))
        if skip_output_reshape:
            return out
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


class PreferredOverride:
    """`DenseOverride` for the calls of a block whose attention module chose its own attention function.

    Current upstream hands each module's choice (``attn.comfy_attention``) to ``optimized_attention`` as
    ``preferred_attention``, and its ``wrap_attn`` drops it once an ``optimized_attention_override`` is set,
    calling the override with the launch's function. Without our node ComfyUI runs the module's function,
    so here it is the function the override receives: a candidate of the dense choice, and what runs
    the calls the override does not serve.

    Args:
        override: the patched model's dense override (its precision and ModelAttentionBackend's choice,
            which still wins over the module's, as in ComfyUI).
        function: the module's attention function.
    """

    def __init__(self, override: DenseOverride, function: Callable):
        self.override = override
        self.function = function

    @torch.compiler.disable
    def __call__(self, func: Callable, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.override(self.function, *args, **kwargs)


def is_ours(override: Any) -> bool:
    """Whether `override` is this pack's dense override (a model's, or one block's `PreferredOverride`)."""
    return isinstance(override, (DenseOverride, PreferredOverride))
