"""tail="coarse" with the learned gate of distilled FastH3 blocks (current upstream's to_gate_compress).

The patched block (current upstream's `attention` argument) is compared in float64 with a block
whose attention is recomputed independently: q, k, v from the test block's own code, the sparse
part with tail="none", and the gated coarse term O_sparse + g * C rebuilt row by
row from the tiling's block memberships, g = x W_gate^T. Tolerance 1e-10 as in test_h3_patch.
"""
from __future__ import annotations

import math

import pytest
import torch

from adaptive_sparse_attention import sparse_attention
from adaptive_sparse_attention.nodes.sparse_call import gate_notice
from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook
from adaptive_sparse_attention.backend.planner import build_plan
from h3_block import block_args, layout_of
from h3_harness import PACKED, TOL, config, model_of, options, reference, run_model
from layouts import memberships


def gated_oracle(cfg):
    """Attention of each block: sparse (tail none) plus g * C, C recomputed from the definitions."""
    layout = layout_of(PACKED)

    def attention_of(block):
        def attention(x, rope_freqs=None, transformer_options=None):
            q, k, v = block.attn.qkv(x, rope_freqs)
            out = sparse_attention(q, k, v, layout, cfg.replace(tail="none"))
            plan = build_plan(q, k, v, layout, cfg)
            member = memberships(plan.q_perm[0, 0], cfg.block_size, layout.total)  # cube: q and k share
            blocks = range(plan.tiling.num_blocks)
            k_mean = torch.stack([k[0, :, member == j].mean(1) for j in blocks], 1)
            v_mean = torch.stack([v[0, :, member == j].mean(1) for j in blocks], 1)
            gate = (x @ block.attn.to_gate_compress.weight.T).view(x.shape[0], block.attn.heads, -1)
            first_sparse = plan.tiling.blocks_of("target_video")[0]  # earlier query blocks run dense
            for row in range(layout.total):
                i = int(member[row])
                if i < first_sparse:
                    continue
                for h in range(block.attn.heads):
                    qq = q[0, h, row] if cfg.tail_granularity == "query" else q[0, h, member == i].mean(0)
                    c = torch.softmax(k_mean[h] @ qq / math.sqrt(q.shape[-1]), 0) @ v_mean[h]
                    out[0, h, row] += gate[row, h] * c
            return block.attn.out_proj(out[0].transpose(0, 1).reshape(x.shape[0], -1))
        return attention
    return attention_of


@pytest.mark.parametrize("granularity", ["block", "query"])
def test_gated_coarse_tail_matches_an_independent_recomputation(granularity):
    model = model_of(True, seed=30, layers=1, gate_compress=True)
    torch.nn.init.normal_(model.blocks[0].attn.to_gate_compress.weight, std=0.3)
    args = block_args(model.blocks[0], PACKED, seed=31, new=True)
    args["transformer_options"] = options()
    cfg = config(tail="coarse", tail_granularity=granularity, topk_ratio=0.3)
    out = run_model(model, SparseAttentionHook(cfg), args, True)
    torch.testing.assert_close(out, reference(model, args, gated_oracle(cfg)), **TOL)
    ungated = run_model(model, SparseAttentionHook(cfg.replace(tail="none")), args, True)
    assert (out - ungated).abs().max() > 1e-4  # the gate really adds the coarse branch


def test_without_a_gate_coarse_stays_zero_and_is_said():
    model = model_of(True, seed=32, layers=1)
    args = block_args(model.blocks[0], PACKED, seed=33, new=True)
    args["transformer_options"] = options()
    cfg = config(tail="coarse", tail_granularity="block", topk_ratio=0.3)
    out = run_model(model, SparseAttentionHook(cfg), args, True)
    torch.testing.assert_close(out, run_model(model, SparseAttentionHook(cfg.replace(tail="none")), args, True), **TOL)
    assert "no to_gate_compress gate" in gate_notice(model, cfg)
    assert gate_notice(model, cfg.replace(tail="reweight")) is None
    gated = model_of(True, seed=34, layers=2, gate_compress=True)
    assert gate_notice(gated, cfg) is None and "tail_granularity='block'" in gate_notice(
        gated, cfg.replace(tail_granularity="query"))
    gated.blocks[1].attn.to_gate_compress = None
    assert "1 of 2 blocks have no to_gate_compress" in gate_notice(gated, cfg)
