"""The cuDNN backend's rows of the timing section (where it can run: sm90 with nvidia-cudnn-frontend).

Beside the cuDNN backend on a plan: the anchor (cuDNN-frontend's block-sparse kernel alone on the
plan's exact keys, Q/K/V packed beforehand), the backend's parts (pack, exact keys, tail and
store), and the whole call with the default tiling on both GPU backends with its planning share.
"""
from __future__ import annotations

import torch

from adaptive_sparse_attention.backend.attention import sparse_attention
from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.backend.layout import SequenceLayout
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.bench.timing import bench_ms, queued_ms
from adaptive_sparse_attention.kernels.cudnn.cudnn_attention import (_forward, block_sparse_cudnn, cudnn_calls,
                                                               exact_attention_cudnn)
from adaptive_sparse_attention.kernels.plan import BlockSparsePlan
from adaptive_sparse_attention.kernels.registry import helper
from adaptive_sparse_attention.kernels.triton.tiled_pack import pack_qkv
from adaptive_sparse_attention.kernels.triton.attention import add_tail
from kernel_cases import DIM, computed_pairs


def cudnn_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan, layout: SequenceLayout,
              ratio: float, gran: str, dense_ms: float, dense_tflops: float) -> dict:
    """The cuDNN backend on `plan` beside the anchor (cuDNN-frontend's kernel alone on the same
    exact keys, Q/K/V packed beforehand) and the whole call on both GPU backends with the
    default tiling."""

    def anchor(plan: BlockSparsePlan) -> float:  # cuDNN's kernel alone on the plan's exact keys, Q/K/V packed
        packed = pack_qkv(q, k, v, plan.q_perm, plan.k_perm)
        calls = cudnn_calls(plan, packed[0], (0, q.shape[1]))
        block_len = plan.block_len.contiguous()
        return bench_ms(lambda: [_forward(qs, packed[1], packed[2], i, n, block_len) for _, qs, i, n in calls])

    exact, summary = computed_pairs(plan)
    anchor_ms = anchor(plan)
    pack, tail = helper("triton", "tiled_pack"), helper("triton", "add_tail")
    ms = bench_ms(lambda: block_sparse_cudnn(q, k, v, plan, pack, tail))
    part = exact_attention_cudnn(q, k, v, plan, pack)
    row = dict(ratio=ratio, gran=gran, anchor_ms=anchor_ms, anchor_tflops=4 * DIM * exact / anchor_ms / 1e9,
               cudnn_backend_ms=ms, cudnn_backend_tflops=4 * DIM * (exact + summary) / ms / 1e9,
               pack_ms=bench_ms(lambda: pack_qkv(q, k, v, plan.q_perm, plan.k_perm)),
               exact_ms=bench_ms(lambda: exact_attention_cudnn(q, k, v, plan, pack)),
               finish_ms=bench_ms(lambda: add_tail(q, plan, part)))
    part = None
    row["anchor_vs_dense_rate"] = row["anchor_tflops"] / dense_tflops
    default = build_plan(q, k, v, layout, SparseConfig(topk_ratio=ratio, tail_granularity=gran, kernel="cudnn",
                                                       strict=True))  # reblock: full blocks, unlike cube's edges
    row["anchor_default_tiling_ms"] = anchor(default)
    row["anchor_default_tiling_vs_dense_rate"] = 4 * DIM * computed_pairs(default)[0] / row["anchor_default_tiling_ms"] \
        / 1e9 / dense_tflops
    default = None
    for backend in ("cudnn", "triton"):
        cfg = SparseConfig(topk_ratio=ratio, tail_granularity=gran, kernel=backend, strict=True)
        row[f"op_default_{backend}_ms"] = bench_ms(lambda: sparse_attention(q, k, v, layout, cfg), rep_ms=1500)
        # planning as the op's share of device time: launches queued behind GPU work, as in a forward pass
        row[f"plan_default_{backend}_ms"], row[f"plan_default_{backend}_host_ms"] = queued_ms(
            lambda: build_plan(q, k, v, layout, cfg), q.device, warmup=1, reps=10)
        row[f"plan_share_{backend}"] = row[f"plan_default_{backend}_ms"] / row[f"op_default_{backend}_ms"]
    print(f"  cudnn r{ratio} {gran:5s}: anchor {anchor_ms:.2f} ms {row['anchor_tflops']:.0f} TFLOP/s "
          f"({100 * row['anchor_vs_dense_rate']:.0f}% of dense rate; default tiling "
          f"{row['anchor_default_tiling_ms']:.2f} ms, {100 * row['anchor_default_tiling_vs_dense_rate']:.0f}%); "
          f"backend {ms:.2f} ms (pack {row['pack_ms']:.2f}, "
          f"exact keys {row['exact_ms']:.2f}, tail and store {row['finish_ms']:.2f}); whole op default tiling "
          f"cudnn {row['op_default_cudnn_ms']:.1f} / triton {row['op_default_triton_ms']:.1f} ms "
          f"(plan {row['plan_default_cudnn_ms']:.1f} ms device, {100 * row['plan_share_cudnn']:.1f}% / "
          f"{100 * row['plan_share_triton']:.1f}%)", flush=True)
    return row
