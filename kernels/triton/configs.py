"""What the Triton kernels share at launch: the dtypes they take, the config of the kernel that adds the
tail to another kernel's result (the per-arch configs: `kernels/arch.py`), the row alignment hint and
the dot precision.

`row_align` is the launch-time alignment hint of every kernel that gathers rows through strides
it does not let Triton specialise (so a new clip length compiles nothing new).
"""
from __future__ import annotations

import torch

from ..arch import KernelConfig, kernel_config, resolve_arch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what every Triton kernel takes


# The kernel finishing a partial result (`block_sparse_triton(partial=...)`: the tail loop only,
# no exact keys): on sm90 at the H3 shapes, 32 summary columns a step and two stages were the
# fastest of those timed (64 columns, one stage, two query blocks a program were slower).
# Other entries use `arch.CONFIGS`.
FINISH_CONFIGS: dict[tuple[str, int, int], KernelConfig] = {
    ("sm90", 64, 64): KernelConfig(64, 64, 32, 4, 2),
    ("sm90", 128, 64): KernelConfig(64, 64, 32, 4, 2),
}


def row_align(*tensors: torch.Tensor) -> int:
    """Largest power of two, at most one 16-byte vector of the first tensor's elements, dividing
    every stride but the innermost of every tensor (a size-1 dimension's stride never counts).

    Kernels state it with `tl.multiple_of` on their row offsets: the batch, head and row strides
    they leave unspecialised would otherwise hide that rows start on a vector boundary, and every
    row would be loaded one element at a time. With the row stride in it, the value does not change
    with the clip length for contiguous tensors, views of H3's qkv buffer or strided samples of them."""
    align = 16 // tensors[0].element_size()
    for t in tensors:
        for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
            while size > 1 and stride % align:
                align //= 2
    return align


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision for operands of `dtype`: full fp32 ("ieee") for fp32 inputs, so
    fp32 runs stay close to the float64 reference; the tensor-core default for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def finish_config(head_dim: int, block_size: int, device: torch.device, arch: str | None = None) -> KernelConfig:
    """Config of the kernel that adds the tail to another kernel's exact-key result (FINISH_CONFIGS,
    else `kernel_config`)."""
    key = (resolve_arch(device, arch), head_dim, 128 if block_size >= 128 else 64)
    return FINISH_CONFIGS.get(key) or kernel_config(head_dim, block_size, device, arch)
