"""GPU generations ("arch") and the launch tiles each plans for: the block-sparse Triton kernel's
configs, and the 8-bit loop's, whose P tiles the torch reference reproduces (`reference/reference.py`).

Archs are told apart by how much shared memory one program may use:
- ``sm80``: sm80/86/89/120 (Ampere, Ada, consumer Blackwell), planned for about 99 KB;
- ``sm90``: sm90/100 (Hopper, datacenter Blackwell), about 227 KB.
A config is picked from the device capability; ``ADAPTIVE_SPARSE_KERNEL_ARCH=sm80|sm90`` (or the
`arch` argument) forces one arch, so the small-memory configs can be proven on a Hopper GPU.
Configs are chosen explicitly rather than autotuned: autotuning with several configs cannot run
under the CPU interpreter, and a fixed choice keeps runs reproducible.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import SparseAttentionError

ARCH_ENV = "ADAPTIVE_SPARSE_KERNEL_ARCH"
ARCHS = ("sm80", "sm90")


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch parameters of one kernel launch.

    block_m: query rows per program; block_n: key rows per step of the exact loop (both are
    capped at the plan's block size: a tile never spans two blocks); block_t: summary columns
    per step of the tail loop.
    """

    block_m: int
    block_n: int
    block_t: int
    num_warps: int
    num_stages: int


# (arch, head_dim, plan block size) -> config. Shared memory is about block_m * head_dim * 2
# bytes for Q plus, per stage, block_n * head_dim * 2 bytes each for K and V: two stages of 64
# keys with 64 queries at head_dim 128 need ~82 KB, under sm80's ~99 KB. Timed on sm90: three
# stages beat two where they fit; 8 warps on a 64-row query tile and key tiles spanning two
# blocks were slower. With 128-row blocks, sm90 takes the whole
# query block in one 8-warp program, so each gathered K/V tile serves twice the queries.
CONFIGS: dict[tuple[str, int, int], KernelConfig] = {
    ("sm80", 32, 64): KernelConfig(64, 64, 64, 4, 3),
    ("sm80", 64, 64): KernelConfig(64, 64, 64, 4, 3),
    ("sm80", 128, 64): KernelConfig(64, 64, 64, 4, 2),
    ("sm80", 32, 128): KernelConfig(64, 64, 64, 4, 3),
    ("sm80", 64, 128): KernelConfig(64, 64, 64, 4, 3),
    ("sm80", 128, 128): KernelConfig(64, 64, 64, 4, 2),
    ("sm90", 32, 64): KernelConfig(64, 64, 64, 4, 3),
    ("sm90", 64, 64): KernelConfig(64, 64, 64, 4, 3),
    ("sm90", 128, 64): KernelConfig(64, 64, 64, 4, 3),
    ("sm90", 32, 128): KernelConfig(128, 64, 64, 8, 2),
    ("sm90", 64, 128): KernelConfig(128, 64, 64, 8, 2),
    ("sm90", 128, 128): KernelConfig(128, 128, 64, 8, 2),
}


def arch_of(capability: tuple[int, int]) -> str:
    """The arch of a CUDA compute capability (major, minor)."""
    return "sm90" if capability[0] in (9, 10) else "sm80"


def resolve_arch(device: torch.device, arch: str | None = None) -> str:
    """The arch to use: the argument, else the environment override, else the device's own."""
    arch = arch or os.environ.get(ARCH_ENV) or None
    if arch is not None:
        if arch not in ARCHS:
            raise SparseAttentionError(f"kernel arch {arch!r} (argument or {ARCH_ENV}) is not allowed: "
                             f"expected one of {', '.join(ARCHS)}")
        return arch
    if device.type == "cuda":
        return arch_of(torch.cuda.get_device_capability(device))
    return "sm80"  # CPU interpreter: tile sizes only matter for speed there


def kernel_config(head_dim: int, block_size: int, device: torch.device, arch: str | None = None) -> KernelConfig:
    """Config for head_dim and plan block size on `device` (optionally forcing an arch).

    Block sizes other than 64 and 128 (hand-built plans) use the 64 entry; the launcher caps
    block_m and block_n at the block size."""
    key = (resolve_arch(device, arch), head_dim, 128 if block_size >= 128 else 64)
    if key not in CONFIGS:
        raise SparseAttentionError(f"block-sparse kernel: head_dim={head_dim} is not supported: expected one of "
                         f"{sorted({d for _, d, _ in CONFIGS})}")
    return CONFIGS[key]


@dataclass(frozen=True)
class EightBitConfig(KernelConfig):
    """A launch of the kernel whose exact loop over the selected key blocks runs in 8 bits: INT8
    Q.K^T and `pv` ("fp8": e4m3 P and V, on GPUs with FP8 MMA; "int8": codes 0..127 for P, signed
    V) for P.V (`triton/attention.py`, `eight_bit.py`)."""

    pv: str


# The 8-bit archs, by compute capability: the P.V format follows the MMA the arch has (FP8 from
# sm89 on), the tiles follow the shared memory (`CONFIGS`' archs: sm89 and sm120 plan for ~99 KB
# as sm80/86 do). The 8-bit loop's stages take half the bf16 loop's memory (one byte per element),
# but the bf16 prefix and tail loops of the same launch keep theirs, so stages are the bf16 configs'.
PV_FORMATS = {"sm80": "int8", "sm89": "fp8", "sm90": "fp8", "sm120": "fp8"}
EIGHT_BIT_ARCHS = tuple(PV_FORMATS)
EIGHT_BIT_CONFIGS: dict[tuple[str, int, int], EightBitConfig] = {
    (arch, d, bs): EightBitConfig(**vars(CONFIGS[("sm90" if arch == "sm90" else "sm80", d, bs)]), pv=pv)
    for arch, pv in PV_FORMATS.items() for d in (32, 64, 128) for bs in (64, 128)
}


def eight_bit_arch(capability: tuple[int, int]) -> str:
    """8-bit arch of a CUDA compute capability (major, minor): sm80 (sm80/86/87), sm89 (Ada),
    sm90 (Hopper, datacenter Blackwell), sm120 (consumer Blackwell)."""
    if capability[0] in (9, 10):
        return "sm90"
    if capability[0] >= 12:
        return "sm120"
    return "sm89" if tuple(capability) >= (8, 9) else "sm80"


def eight_bit_config(head_dim: int, block_size: int, device: torch.device, arch: str | None = None
                     ) -> EightBitConfig:
    """The 8-bit launch for head_dim and plan block size on `device`: the arch is the argument,
    else ``ADAPTIVE_SPARSE_KERNEL_ARCH`` (any of `EIGHT_BIT_ARCHS`), else the device's own
    (sm89, FP8 P.V, on the CPU, where it only decides the arithmetic the interpreter reproduces)."""
    arch = arch or os.environ.get(ARCH_ENV) or None
    if arch is None:
        arch = eight_bit_arch(torch.cuda.get_device_capability(device)) if device.type == "cuda" else "sm89"
    if arch not in EIGHT_BIT_ARCHS:
        raise SparseAttentionError(f"8-bit kernel arch {arch!r} (argument or {ARCH_ENV}) is not allowed: expected one of "
                         f"{', '.join(EIGHT_BIT_ARCHS)}")
    key = (arch, head_dim, 128 if block_size >= 128 else 64)
    if key not in EIGHT_BIT_CONFIGS:
        raise SparseAttentionError(f"8-bit block-sparse kernel: head_dim={head_dim} is not supported: expected one of "
                         f"{sorted({d for _, d, _ in EIGHT_BIT_CONFIGS})}")
    return EIGHT_BIT_CONFIGS[key]
