"""Launch-config variants of the kernel at the 10s shape, ratio 0.1 (section `variants`), and the
shared memory, registers and spills of every kernel variant compiled so far."""
from __future__ import annotations

import torch

from adaptive_sparse_attention.backend.layout import SequenceLayout
from adaptive_sparse_attention.kernels.arch import KernelConfig
from kernel_cases import plan_for
from kernel_rows import kernel_row

VARIANTS = {  # name -> (plan block size, launch config)
    "bs64 m64n64t64w4s2": (64, KernelConfig(64, 64, 64, 4, 2)),
    "bs64 m64n64t64w4s3": (64, KernelConfig(64, 64, 64, 4, 3)),
    "bs128 m64n64t64w4s3": (128, KernelConfig(64, 64, 64, 4, 3)),
    "bs128 m128n64t64w8s2": (128, KernelConfig(128, 64, 64, 8, 2)),
    "bs128 m128n64t64w8s3": (128, KernelConfig(128, 64, 64, 8, 3)),
    "bs128 m128n128t64w8s2": (128, KernelConfig(128, 128, 64, 8, 2)),
}


def variant_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout, dense_ms: float,
                 dense_tflops: float) -> dict:
    """name -> kernel row of every variant on the ratio-0.1 plan of its block size (or the error of a
    variant that does not fit: reported, not fatal)."""
    plans = {bs: plan_for(q, k, v, layout, 0.1, block_size=bs)[0] for bs in (64, 128)}
    rows = {}
    for name, (bs, conf) in VARIANTS.items():
        try:
            rows[name] = kernel_row(q, k, v, plans[bs], conf, dense_ms, dense_tflops)
            print(f"  variant {name}: {rows[name]['kernel_ms']:.2f} ms {rows[name]['tflops']:.0f} TFLOP/s",
                  flush=True)
        except Exception as e:
            rows[name] = {"error": repr(e)[:300]}
            print(f"  variant {name}: {repr(e)[:200]}", flush=True)
    return rows


def compiled_resources() -> list[dict]:
    """Shared memory, registers and spills of every compiled kernel variant (best effort: Triton's
    cache layout is not a public API)."""
    from adaptive_sparse_attention.kernels.triton import attention as ta

    seen = []
    try:
        for caches in ta._block_sparse_fwd.device_caches.values():
            for kern in caches[0].values():
                md = kern.metadata
                seen.append(dict(shared=md.shared, warps=md.num_warps, stages=md.num_stages,
                                 regs=getattr(kern, "n_regs", None), spills=getattr(kern, "n_spills", None)))
    except (AttributeError, TypeError, IndexError) as e:
        seen.append({"error": repr(e)})
    return seen
