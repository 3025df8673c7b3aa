"""What every compiled attention kernel's `torch.library` custom op shares, so `torch.compile` can trace through them.

Each family registers its own op beside its kernel (`triton/op.py`, `cudnn/op.py`). A custom op
takes tensors and plain values, not dataclasses: the plan crosses it as `BlockSparsePlan.flatten()`
and is put back together inside by `BlockSparsePlan.unflatten`. The ops' fake implementation
(`fake_attention`) only describes the outputs. Importing an op's module registers it; the kernel's
own module (and with it Triton or cuDNN) is imported only when the op runs.

The ops' namespace is this copy's own (`op_name`): a process that imports the pack twice (the
benchmark and ComfyUI's loader, which names the module by its folder path) would otherwise register
each op twice under one name, and torch then runs the later copy's implementation from the earlier
copy's op.
"""
import hashlib

import torch

from ..errors import SparseAttentionError

PACKAGE = __name__.rsplit(".kernels.", 1)[0]  # the name this copy was imported under
NAMESPACE = "adaptive_sparse_attention"


def op_name(name: str, package: str = PACKAGE) -> str:
    """The qualified name of custom op `name` for the copy imported as `package`: NAMESPACE::name for
    the installed package, NAMESPACE_<hash of the package name>::name for a copy under another name."""
    if package == NAMESPACE:
        return f"{NAMESPACE}::{name}"
    return f"{NAMESPACE}_{hashlib.sha1(package.encode()).hexdigest()[:10]}::{name}"


def fake_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan_tensors: list[torch.Tensor],
                   block_size: int, groups: list[int], tail: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs' shapes and dtypes of an attention op: (out like q, lse [B, H, S] fp32)."""
    B, H, S, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, H, S, dtype=torch.float32)


def check_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, family: str) -> None:
    """Refuse inputs that require grad (with grad mode on): the kernels are forward only, so this
    fails before anything runs instead of returning outputs whose backward fails later."""
    needs_grad = [name for name, t in (("q", q), ("k", k), ("v", v)) if t.requires_grad]
    if needs_grad and torch.is_grad_enabled():
        raise SparseAttentionError(f"kernel={family!r}: {', '.join(needs_grad)} require grad, but the fused kernels have no "
                         "backward: call it under torch.no_grad() or torch.inference_mode(), detach the inputs, or use "
                         "kernel='torch' (the differentiable reference)")

