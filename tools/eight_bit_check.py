"""The 8-bit exact loop on a CUDA GPU: every arch's 8-bit config run on this GPU and checked, then
timed against the bf16 kernel at the H3 shapes.

1. Mid shape (text 256 + audio 200 + video 5 x 24 x 42, 4 heads x 128, bf16 random inputs, the
   node's default plan at ratio 0.2): for each arch's 8-bit config (`EIGHT_BIT_CONFIGS`: sm80's INT8
   P.V, sm89/sm90/sm120's FP8 P.V), the kernel against the torch reference of the same quantisation
   (fp32 accumulation on the GPU), against the exact sparse result and against dense fp32 attention;
   the bf16 kernel's errors beside them.
2. 10 s shape (S 73,642, 56 x 128, H3's strided q/k/v, default plan): the kernel in bf16 (tiled) and
   in 8 bits (this GPU's config, and every other arch's config), the 8-bit pre-pass alone, and the
   whole `sparse_attention` call in both precisions, per ratio; medians by CUDA events
   (`triton.testing.do_bench`).

    python tools/eight_bit_check.py --ratios 0.1,0.2 --out eight_bit.json
"""
from __future__ import annotations

import argparse
import json

import torch

from adaptive_sparse_attention.backend.attention import sparse_attention
from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.backend.layout import SequenceLayout
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.bench.scenes import h3_qkv
from adaptive_sparse_attention.bench.timing import bench_ms
from adaptive_sparse_attention.kernels import block_sparse_reference
from adaptive_sparse_attention.kernels.triton import attention as ta
from adaptive_sparse_attention.kernels.triton.block_quantise import quantise_blocks_triton
from adaptive_sparse_attention.kernels.arch import EIGHT_BIT_ARCHS, EIGHT_BIT_CONFIGS, eight_bit_config
from adaptive_sparse_attention.kernels.eight_bit import key_mean, value_max
from kernel_cases import DIM, H3_SHAPES, HEADS


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def mid_shape_check(results: dict) -> None:
    layout = SequenceLayout.from_segments([(0, 256, "text"), (256, 456, "audio"),
                                           (456, 456 + 5 * 24 * 42, "video", (5, 24, 42))])
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 4, layout.total, DIM, device="cuda", generator=g, dtype=torch.bfloat16)
               for _ in range(3))
    plan = build_plan(q, k, v, layout, SparseConfig(topk_ratio=0.2, kernel="triton", min_tokens=0))
    qf, kf, vf = q.float(), k.float(), v.float()
    dense = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf)
    exact, _ = block_sparse_reference(qf, kf, vf, plan)
    bf16, _ = ta.block_sparse_triton(q, k, v, plan)
    row = {"S": layout.total, "density": plan.density(), "bf16_vs_exact_sparse": rel(bf16, exact),
           "bf16_vs_dense_fp32": rel(bf16, dense), "exact_sparse_vs_dense_fp32": rel(exact, dense), "archs": {}}
    print(f"mid shape S {layout.total}: bf16 kernel rel L2 vs exact sparse {row['bf16_vs_exact_sparse']:.2e}, "
          f"vs dense fp32 {row['bf16_vs_dense_fp32']:.3e}", flush=True)
    for arch in EIGHT_BIT_ARCHS:
        conf = EIGHT_BIT_CONFIGS[(arch, DIM, 64)]
        try:
            out, lse = ta.block_sparse_triton(q, k, v, plan, conf, precision="8-bit")
            ref, ref_lse = block_sparse_reference(qf, kf, vf, plan, eight_bit=conf)
            r = {"pv": conf.pv, "vs_same_quantisation_max_abs": float((out.float() - ref).abs().max()),
                 "vs_same_quantisation_rel": rel(out, ref), "lse_max_abs": float((lse - ref_lse).abs().max()),
                 "vs_exact_sparse": rel(out, exact), "vs_dense_fp32": rel(out, dense),
                 "finite": bool(torch.isfinite(out).all())}
        except Exception as e:  # reported per arch, the others still run
            r = {"error": repr(e)[-500:]}
        row["archs"][arch] = r
        print(f"  8-bit {arch} config: {r}", flush=True)
    results["mid"] = row


def timing(results: dict, ratios: list[float], other_archs: bool = True) -> None:
    layout = H3_SHAPES["10s"].layout()
    q, k, v = h3_qkv(layout, HEADS, DIM, torch.bfloat16, seed=7)
    own = eight_bit_config(DIM, 64, q.device)
    results["own_arch_pv"] = own.pv
    rows = results["10s"] = []
    mean, v_max = key_mean(k), value_max(v)
    for ratio in ratios:
        cfg = SparseConfig(topk_ratio=ratio, kernel="triton", min_tokens=0)
        plan = build_plan(q, k, v, layout, cfg)
        row = {"ratio": ratio, "density": plan.density()}
        row["kernel_bf16_ms"] = bench_ms(lambda: ta.block_sparse_triton(q, k, v, plan))
        row["kernel_8bit_ms"] = bench_ms(lambda: ta.block_sparse_triton(q, k, v, plan, precision="8-bit"))
        row["pre_pass_8bit_ms"] = bench_ms(lambda: [quantise_blocks_triton(
            q, k, v, plan.q_perm, plan.k_perm, mean, v_max, 64, h0, min(HEADS, h0 + ta.HEADS_PER_CALL), own.pv)
            for h0 in range(0, HEADS, ta.HEADS_PER_CALL)])
        row["op_bf16_ms"] = bench_ms(lambda: sparse_attention(q, k, v, layout, cfg))
        row["op_8bit_ms"] = bench_ms(lambda: sparse_attention(q, k, v, layout, cfg.replace(precision="8-bit")))
        print(f"10s r{ratio}: kernel bf16 {row['kernel_bf16_ms']:.1f} ms, 8-bit {row['kernel_8bit_ms']:.1f} ms "
              f"(pre-pass {row['pre_pass_8bit_ms']:.1f}); op bf16 {row['op_bf16_ms']:.1f}, 8-bit "
              f"{row['op_8bit_ms']:.1f}", flush=True)
        for arch in EIGHT_BIT_ARCHS:
            conf = EIGHT_BIT_CONFIGS[(arch, DIM, 64)]
            if conf == own or not other_archs:
                continue
            try:
                row[f"kernel_8bit_{arch}_config_ms"] = bench_ms(
                    lambda: ta.block_sparse_triton(q, k, v, plan, conf, precision="8-bit"), rep_ms=500)
            except Exception as e:
                row[f"kernel_8bit_{arch}_config_error"] = repr(e)[-300:]
            print(f"  8-bit {arch} config: {row.get(f'kernel_8bit_{arch}_config_ms')}", flush=True)
        rows.append(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", default="0.1,0.2")
    parser.add_argument("--skip-mid", action="store_true")
    parser.add_argument("--own-arch-only", action="store_true", help="time only this GPU's 8-bit config")
    parser.add_argument("--out", default="eight_bit.json")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    results["triton"] = triton.__version__
    try:
        if not args.skip_mid:
            mid_shape_check(results)
        torch.cuda.empty_cache()
        timing(results, [float(r) for r in args.ratios.split(",")], not args.own_arch_only)
    finally:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
