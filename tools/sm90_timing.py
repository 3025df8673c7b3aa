"""The sm90 kernel at the H3 shapes beside the Triton kernel and the dense anchors, on one plan (a GPU tool).

Per shape (56 heads x 128, bf16, the node's default plan at each ratio): the Triton attention and the sm90
attention on the same plan (each whole: pack, exact keys, tail and store), the sm90 call's parts (pack,
exact keys, tail), their largest difference, and dense SDPA cuDNN and FlashAttention-4 (where it imports)
on the same q, k, v; exact-pair TFLOP/s (4 x pairs x D) of each. Prints one line per case and writes JSON.

    python tools/sm90_timing.py --shapes 5s,10s --ratios 0.2 --out sm90.json
"""
from __future__ import annotations

import argparse
import json

import torch

from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.bench.scenes import h3_qkv
from adaptive_sparse_attention.bench.timing import bench_ms
from adaptive_sparse_attention.kernels.packed import exact_in_chunks
from adaptive_sparse_attention.kernels.registry import helper, resolve
from adaptive_sparse_attention.kernels.sm90 import attention as sm90
from adaptive_sparse_attention.kernels.sm90.op import HEADS_PER_CALL
from kernel_cases import DIM, H3_SHAPES, computed_pairs, pack_chunks


def dense_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """Dense attention on the same inputs: SDPA cuDNN and FlashAttention-4 (where it imports), ms and TFLOP/s."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    S = q.shape[2]
    flop = 4 * q.shape[1] * S * S * DIM
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        rows = {"dense_cudnn_ms": bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))}
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        rows["dense_fa4_ms"] = None
    else:
        qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
        rows["dense_fa4_ms"] = bench_ms(lambda: flash_attn_func(qs, ks, vs))
    for name in ("cudnn", "fa4"):
        ms = rows[f"dense_{name}_ms"]
        rows[f"dense_{name}_tflops"] = None if ms is None else flop / ms / 1e9
    return rows


def case(shape: str, ratio: float, stages: tuple[tuple[int, int], ...]) -> dict:
    size = H3_SHAPES[shape]
    layout = size.layout()
    q, k, v = h3_qkv(layout, size.heads, size.head_dim, torch.bfloat16, seed=0)
    plan = build_plan(q, k, v, layout, SparseConfig(topk_ratio=ratio, strict=True))
    exact, summary = computed_pairs(plan)
    pack, tail = helper("triton", "tiled_pack"), helper("triton", "add_tail")
    triton_attn = resolve("triton", q.device, q.dtype, strict=True, head_dim=DIM, block_size=64).attention
    sm90_attn = resolve("sm90", q.device, q.dtype, strict=True, head_dim=DIM, block_size=64).attention
    row = dict(shape=shape, ratio=ratio, S=layout.total, density=exact / (q.shape[1] * layout.total ** 2),
               exact_tflop=4 * DIM * exact / 1e12, summary_tflop=4 * DIM * summary / 1e12)
    ref, ref_lse = triton_attn.attend_blocks(q, k, v, plan)
    out, lse = sm90_attn.attend_blocks(q, k, v, plan)
    row["max_abs_diff_vs_triton"] = float((out.float() - ref.float()).abs().max())
    row["max_lse_diff_vs_triton"] = float((lse - ref_lse).abs().max())
    row["triton_ms"] = bench_ms(lambda: triton_attn.attend_blocks(q, k, v, plan))
    row["sm90_ms"] = bench_ms(lambda: sm90_attn.attend_blocks(q, k, v, plan))
    row["pack_ms"] = bench_ms(lambda: pack_chunks(q, k, v, plan, pack, HEADS_PER_CALL))
    for s in stages:
        def exact_only(s=s):
            return exact_in_chunks(q, k, v, plan, pack, lambda qp, kp, vp, p, h: sm90.exact_keys_sm90(
                qp, kp, vp, p, h, stages=s), HEADS_PER_CALL)
        row[f"sm90_pack_exact_stages{s[0]}x{s[1]}_ms"] = bench_ms(exact_only)
    part = exact_in_chunks(q, k, v, plan, pack, sm90.exact_keys_sm90, HEADS_PER_CALL)
    row["tail_ms"] = bench_ms(lambda: tail(q, plan, part))
    part = None
    row.update(dense_rows(q, k, v))
    for name in ("triton", "sm90"):
        row[f"{name}_exact_tflops"] = row["exact_tflop"] * 1e3 / row[f"{name}_ms"]
    best = max(r for r in (row["dense_cudnn_tflops"], row["dense_fa4_tflops"]) if r is not None)
    row["sm90_vs_dense_rate"] = row["sm90_exact_tflops"] / best
    print(f"{shape} r{ratio}: density {row['density']:.3f}, triton {row['triton_ms']:.2f} ms, sm90 "
          f"{row['sm90_ms']:.2f} ms ({row['sm90_exact_tflops']:.0f} TFLOP/s exact pairs, "
          f"{100 * row['sm90_vs_dense_rate']:.0f}% of the best dense rate {best:.0f}); pack "
          f"{row['pack_ms']:.2f}, " + ", ".join(f"pack+exact K{s[0]}V{s[1]} "
                                               f"{row[f'sm90_pack_exact_stages{s[0]}x{s[1]}_ms']:.2f}" for s in stages)
          + f", tail {row['tail_ms']:.2f}; dense cuDNN {row['dense_cudnn_ms']:.1f} FA4 {row['dense_fa4_ms']}; "
          f"max |sm90 - triton| {row['max_abs_diff_vs_triton']:.2e} (lse {row['max_lse_diff_vs_triton']:.2e})",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="5s,10s")
    ap.add_argument("--ratios", default="0.2")
    ap.add_argument("--stages", default="2x2,3x2", help="K x V ring slots of the exact-keys variants timed")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    stages = tuple(tuple(int(n) for n in x.split("x")) for x in a.stages.split(","))
    rows = [case(s, float(r), stages)
            for s in a.shapes.split(",") for r in a.ratios.split(",")]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                           triton=__import__("triton").__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
