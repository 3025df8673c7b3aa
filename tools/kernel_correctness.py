"""The Triton kernel against the float64 reference at about 8k tokens (section `check`).

Per dtype, head dim, tail granularity and arch (forced): relative L2 and max
error, the log-sum-exp error, and identical bits across repeated runs. Freed memory is filled
with NaN first, so a row the kernel fails to write shows up as NaN instead of stale numbers.
"""
from __future__ import annotations

import torch

from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.backend.layout import SequenceLayout
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.bench.scenes import h3_qkv
from adaptive_sparse_attention.kernels.arch import ARCHS, kernel_config
from adaptive_sparse_attention.kernels.reference.reference import block_sparse_reference
from adaptive_sparse_attention.kernels.triton.attention import block_sparse_triton


def poison_allocator(nbytes: int) -> None:
    """Fill freed allocator memory with NaN so that rows the kernel fails to write show up."""
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


def correctness(results: dict, quick: bool, block_size: int) -> None:
    """Append one row per case and arch to results["correctness"] and print it.

    Args:
        results: the check's results, extended in place.
        quick: only the first case.
        block_size: the plans' block size (64 or 128).
    """
    layout = SequenceLayout.from_segments([(0, 256, "text"), (256, 670, "audio"),
                                           (670, 670 + 4 * 24 * 30, "ref_video", (4, 24, 30)),
                                           (3550, 3550 + 7 * 21 * 30, "video", (7, 21, 30))])  # S = 7960
    cases = [(torch.bfloat16, 128, "query"), (torch.bfloat16, 128, "block"), (torch.float16, 64, "query"),
             (torch.bfloat16, 32, "block")] if block_size == 64 else [
             (torch.bfloat16, 128, "query"), (torch.float16, 64, "block"), (torch.bfloat16, 32, "query")]
    rows = []
    for dtype, dim, gran in cases:
        q, k, v = h3_qkv(layout, 4, dim, dtype, seed=dim)
        cfg = SparseConfig(tiling="cube", topk_ratio=0.15, sparse_scope="joint-video", tail_granularity=gran,
                           block_size=block_size)
        plan = build_plan(q, k, v, layout, cfg)
        ref, ref_lse = block_sparse_reference(q.double(), k.double(), v.double(), plan)
        low, _ = block_sparse_reference(q, k, v, plan)  # fp32 math, output rounded to dtype
        low_err = float((low.double() - ref).abs().max())
        for arch in ARCHS:
            conf = kernel_config(dim, plan.block_size, q.device, arch=arch)
            poison_allocator(4 * q.numel() * q.element_size())
            out, lse = block_sparse_triton(q, k, v, plan, config=conf)
            again = [block_sparse_triton(q, k, v, plan, config=conf) for _ in range(2)]
            same = all(torch.equal(o, out) and torch.equal(l, lse) for o, l in again)
            err = (out.double() - ref)
            row = dict(dtype=str(dtype).split(".")[-1], dim=dim, gran=gran, block_size=block_size, arch=arch,
                       config=conf.__dict__,
                       rel_l2=float(err.norm() / ref.norm()), max_abs=float(err.abs().max()),
                       ref_lowprec_max_abs=low_err, lse_max_abs=float((lse.double() - ref_lse).abs().max()),
                       finite=bool(torch.isfinite(out).all()), bit_identical=same)
            row["ok"] = row["finite"] and same and row["rel_l2"] < 1e-2 and row["max_abs"] < max(4 * low_err, 2e-2) \
                and row["lse_max_abs"] < 1e-3
            rows.append(row)
            print(f"check bs{block_size} {row['dtype']} D{dim} {gran:5s} {arch}: rel_l2 {row['rel_l2']:.2e} "
                  f"max {row['max_abs']:.2e} (fp32-ref rounded {low_err:.2e}) lse {row['lse_max_abs']:.1e} identical {same} ok {row['ok']}",
                  flush=True)
        if quick:
            break
    results.setdefault("correctness", []).extend(rows)
