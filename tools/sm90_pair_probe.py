"""Probe: the sm90 kernel with two query blocks a CTA sharing one key list (a GPU tool, issue 62).

Two adjacent query blocks (2p, 2p + 1) routed as one (their length-weighted mean query scores the key blocks:
one list for both) let a CTA hold both query tiles, one consumer warpgroup each, and load every listed K/V
block once for 128 query rows, as a dense kernel does; per-block lists cannot share a ring without coupling
the two consumers (docs/performance-notes.md). This measures what that CTA runs at, against the kernel of
today on the same plan, before the planner grows the option: per shape, the node's default plan with its
q2k rows routed in pairs (`paired_plan`), the pair kernel's exact part and today's (`exact_keys_sm90`), their
largest difference, exact-pair TFLOP/s, and dense cuDNN SDPA beside them. JSON with --out.

    python tools/sm90_pair_probe.py --shapes 10s,5s --ratio 0.2 --out pair.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.backend.planner import build_plan, call_kernels, routing_scores
from adaptive_sparse_attention.backend.pooling import block_means
from adaptive_sparse_attention.backend.routing import route_blocks
from adaptive_sparse_attention.bench.scenes import h3_qkv
from adaptive_sparse_attention.bench.timing import bench_ms
from adaptive_sparse_attention.kernels.packed import exact_in_chunks
from adaptive_sparse_attention.kernels.plan import BlockSparsePlan, group_span
from adaptive_sparse_attention.kernels.registry import helper
from adaptive_sparse_attention.kernels.sm90 import attention as sm90
from adaptive_sparse_attention.kernels.sm90.op import HEADS_PER_CALL
from kernel_cases import DIM, H3_SHAPES, computed_pairs, pack_chunks


def exact_keys_pair(qp, kp, vp, plan: BlockSparsePlan, heads: tuple[int, int], stages=(2, 2), maxnreg: int = 168):
    """`exact_keys_sm90` with two query blocks a CTA (a 128-row Q descriptor, 8 warps: two consumer warpgroups) on
    the first block's list (a plan routed in pairs)."""
    B, hc, L, D = qp.shape
    J = plan.num_blocks
    Lp = (J + 1) // 2 * 2 * sm90.BLOCK
    q_layout = gl.NVMMASharedLayout.get_default_for([2 * sm90.BLOCK, D], sm90.DTYPES[qp.dtype])
    q_desc = TensorDescriptor.from_tensor(qp.view(B * hc * L, D), [2 * sm90.BLOCK, D], q_layout)
    layout = sm90.shared_layout(D, qp.dtype)
    k_desc, v_desc = (TensorDescriptor.from_tensor(t.view(B * hc * L, D), [sm90.BLOCK, D], layout) for t in (kp, vp))
    out = torch.empty(B, hc, Lp, D, dtype=qp.dtype, device=qp.device)
    lse = torch.empty(B, hc, Lp, dtype=torch.float32, device=qp.device)
    q2k_idx = plan.q2k_idx.contiguous()
    sm90._exact_keys_sm90[((J + 1) // 2, B * hc)](
        q_desc, k_desc, v_desc, out, lse, plan.block_len.contiguous(), plan.dense_hi.contiguous(), q2k_idx,
        plan.q2k_num.contiguous(), plan.q2k_idx.shape[1], heads[0], hc, J, q2k_idx.shape[-1],
        D ** -0.5 * 1.4426950408889634, K_STAGES=stages[0], V_STAGES=stages[1], num_warps=8, maxnreg=maxnreg)
    return out[:, :, :L], lse[:, :, :L]


def paired_plan(q, k, v, layout, cfg: SparseConfig) -> BlockSparsePlan:
    """The node's plan with its key blocks chosen per pair of query blocks: the pair's length-weighted mean
    query routes for both, and block 2p + 1 takes block 2p's dense prefix (one list a pair)."""
    plan = build_plan(q, k, v, layout, cfg)
    kernels = call_kernels(q, layout, cfg)
    t = plan.tiling
    qm = block_means(q, t.q_perm, t, kernels)
    km = block_means(k, t.k_perm, t, kernels)
    J = qm.shape[2]
    even = J // 2 * 2
    n = t.block_len.float().view(1, 1, J, 1)
    avg = ((qm[:, :, 0:even:2] * n[:, :, 0:even:2] + qm[:, :, 1:even:2] * n[:, :, 1:even:2])
           / (n[:, :, 0:even:2] + n[:, :, 1:even:2]).clamp(min=1))
    qm = qm.clone()
    qm[:, :, 0:even:2], qm[:, :, 1:even:2] = avg, avg
    dense_hi = plan.dense_hi.clone()
    dense_hi[1:even:2] = dense_hi[0:even:2]
    idx, num = route_blocks(qm, km, dense_hi, plan.groups, routing_scores(cfg, q.device, layout.cache.notices),
                            kernels, group_span(plan.groups))
    idx[:, :, 1:even:2], num[:, :, 1:even:2] = idx[:, :, 0:even:2], num[:, :, 0:even:2]
    return dataclasses.replace(plan, dense_hi=dense_hi, q2k_idx=idx.to(plan.q2k_idx.dtype), q2k_num=num)


def case(shape: str, ratio: float) -> dict:
    size = H3_SHAPES[shape]
    layout = size.layout()
    q, k, v = h3_qkv(layout, size.heads, size.head_dim, torch.bfloat16, seed=0)
    plan = paired_plan(q, k, v, layout, SparseConfig(topk_ratio=ratio, strict=True))
    exact, _ = computed_pairs(plan)
    pack = helper("triton", "tiled_pack")
    row = dict(shape=shape, ratio=ratio, S=layout.total, exact_tflop=4 * DIM * exact / 1e12)

    def today():
        return exact_in_chunks(q, k, v, plan, pack, sm90.exact_keys_sm90, HEADS_PER_CALL)

    def pair():
        return exact_in_chunks(q, k, v, plan, pack, exact_keys_pair, HEADS_PER_CALL)

    (o1, l1), (o2, l2) = today(), pair()
    valid = torch.isfinite(l1)
    row["max_abs_diff"] = float((o1.float() - o2.float()).abs().amax(-1)[valid].max())
    row["max_lse_diff"] = float((l1 - l2)[valid].abs().max())
    row["nan"] = int(torch.isnan(o2).sum())
    row["pack_ms"] = bench_ms(lambda: pack_chunks(q, k, v, plan, pack, HEADS_PER_CALL))
    row["today_ms"] = bench_ms(today)
    row["pair_ms"] = bench_ms(pair)
    row["pair_3x3_ms"] = bench_ms(lambda: exact_in_chunks(q, k, v, plan, pack, lambda *a: exact_keys_pair(
        *a, stages=(3, 3)), HEADS_PER_CALL))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        row["dense_cudnn_ms"] = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    for name in ("today", "pair", "pair_3x3"):
        row[f"{name}_exact_tflops"] = row["exact_tflop"] * 1e3 / (row[f"{name}_ms"] - row["pack_ms"])
    row["dense_cudnn_tflops"] = 4 * q.shape[1] * layout.total ** 2 * DIM / row["dense_cudnn_ms"] / 1e9
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="10s,5s")
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [case(s, a.ratio) for s in a.shapes.split(",")]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                           triton=__import__("triton").__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
