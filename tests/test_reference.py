"""The reference engine against independent computations and its invariants (float64 on CPU).

Tolerances: float64 end to end, so agreement is limited only by summation order; 1e-10 is
far above that (~1e-15 per term) and far below any real bug.
"""
import dataclasses
import math

import pytest
import torch

from adaptive_sparse_attention import SparseConfig, sparse_attention
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.kernels import EMPTY_ROW_LSE, block_sparse_reference
from layouts import awkward_layout, memberships

TOL = 1e-10


def qkv(layout, heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, layout.total, dim, generator=g, dtype=torch.float64) for _ in range(3)]


def dense(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v


def independent(q, k, v, layout, cfg, plan):
    """Sparse attention recomputed row by row from the definitions; only the selection is read
    from the plan (and is itself checked against the pooled scores in test_routing)."""
    B, H, S, D = q.shape
    kp, bs, J = plan, plan.tiling.block_size, plan.tiling.num_blocks
    out = torch.zeros_like(q)
    t = layout.target
    for h in range(H):
        qb = memberships(kp.q_perm[0, min(h, kp.q_perm.shape[1] - 1)], bs, S)
        kb = memberships(kp.k_perm[0, min(h, kp.k_perm.shape[1] - 1)], bs, S)
        members = [torch.nonzero(kb == j).squeeze(1) for j in range(J)]
        qmembers = [torch.nonzero(qb == j).squeeze(1) for j in range(J)]
        anchor = q[0, h, t.start:t.stop].mean(0)
        summ = []
        for j in range(J):
            kk, vv = k[0, h, members[j]], v[0, h, members[j]]
            if cfg.tail == "mean":
                summ.append((kk.mean(0), vv.mean(0), math.log(len(members[j]))))
            else:
                w = torch.softmax(kk @ anchor / math.sqrt(D), 0)
                key = w @ kk
                summ.append((key, w @ vv, torch.logsumexp(kk @ anchor / math.sqrt(D), 0) - key @ anchor / math.sqrt(D)))
        for i in range(J):
            hi = int(kp.dense_hi[i])
            sel = set(kp.q2k_idx[0, h, i, : kp.q2k_num[0, h, i]].tolist())
            exact = torch.cat([members[j] for j in range(J) if j < hi or j in sel])
            unsel = [j for j in range(hi, J) if j not in sel]
            for row in qmembers[i].tolist():
                qq = q[0, h, row]
                logits = [k[0, h, exact] @ qq / math.sqrt(D)]
                values = [v[0, h, exact]]
                if cfg.tail in ("mean", "reweight") and unsel:
                    if cfg.tail_granularity == "query":
                        logits.append(torch.stack([summ[j][0] @ qq / math.sqrt(D) + summ[j][2] for j in unsel]))
                        values.append(torch.stack([summ[j][1] for j in unsel]))
                    else:
                        qm = q[0, h, qmembers[i]].mean(0)
                        sl = torch.stack([summ[j][0] @ qm / math.sqrt(D) + summ[j][2] for j in unsel])
                        logits.append(torch.logsumexp(sl, 0).view(1))
                        values.append((torch.softmax(sl, 0) @ torch.stack([summ[j][1] for j in unsel])).view(1, D))
                p = torch.softmax(torch.cat(logits), 0)
                out[0, h, row] = p @ torch.cat(values)
    return out


@pytest.mark.parametrize("tail", ["none", "mean", "reweight"])
@pytest.mark.parametrize("granularity", ["query", "block"])
@pytest.mark.parametrize("scope", ["target-video", "joint-video"])
def test_every_tail_mode_matches_an_independent_computation(tail, granularity, scope):
    lay = awkward_layout()
    q, k, v = qkv(lay, seed=3)
    cfg = SparseConfig(topk_ratio=0.3, tiling="cube", tail=tail, tail_granularity=granularity,
                       sparse_scope=scope, kernel="torch")
    plan = build_plan(q, k, v, lay, cfg)
    out = sparse_attention(q, k, v, lay, cfg)
    assert (out - independent(q, k, v, lay, cfg, plan)).abs().max() < TOL


@pytest.mark.parametrize("granularity", ["query", "block"])
def test_coarse_adds_the_gated_pooled_branch_to_sparse_rows_only(granularity):
    lay = awkward_layout()
    q, k, v = qkv(lay, seed=4)
    base = SparseConfig(topk_ratio=0.3, tiling="cube", tail="none", kernel="torch")
    cfg = base.replace(tail="coarse", tail_granularity=granularity)
    gate = torch.tensor([0.5, -2.0], dtype=torch.float64).view(2, 1, 1)
    plan = build_plan(q, k, v, lay, cfg)
    got = sparse_attention(q, k, v, lay, cfg, coarse_gate=gate)
    expect = sparse_attention(q, k, v, lay, base)
    perm = plan.q_perm[0, 0]
    qb = memberships(perm, 64, lay.total)
    J = plan.tiling.num_blocks
    kmean = torch.stack([k[0, :, (qb == j)].mean(1) for j in range(J)], 1)  # cube tiling: q and k share blocks
    vmean = torch.stack([v[0, :, (qb == j)].mean(1) for j in range(J)], 1)
    lo = plan.tiling.blocks_of("target_video")[0]
    for h in range(2):
        for row in range(lay.total):
            i = int(qb[row])
            if i < lo:
                continue
            qq = q[0, h, row] if granularity == "query" else q[0, h, qb == i].mean(0)
            c = torch.softmax(kmean[h] @ qq / math.sqrt(32), 0) @ vmean[h]
            expect[0, h, row] += gate[h, 0, 0] * c
    assert (got - expect).abs().max() < TOL
    # without a gate (the base model has none) coarse adds nothing
    assert torch.equal(sparse_attention(q, k, v, lay, cfg), sparse_attention(q, k, v, lay, base))


@pytest.mark.parametrize("tail", ["none", "mean", "reweight", "coarse"])
@pytest.mark.parametrize("scope", ["target-video", "joint-video"])
def test_ratio_one_equals_dense(tail, scope):
    lay = awkward_layout()
    q, k, v = qkv(lay, heads=1, seed=5)
    for granularity in ("query", "block"):
        cfg = SparseConfig(topk_ratio=1.0, tiling="cube", tail=tail, tail_granularity=granularity,
                           sparse_scope=scope, kernel="torch")
        out, info = sparse_attention(q, k, v, lay, cfg, return_info=True)  # coarse: no gate, as in base H3
        assert (out - dense(q, k, v)).abs().max() < TOL
        assert info.density == pytest.approx(1.0)


def test_selected_summaries_are_never_double_counted():
    """At ratio 1.0 every candidate block is selected while the plan still carries a summary of
    each: the reference must leave them all out and give dense attention. The same summaries in
    place of the exact blocks move the output by more than 1e-3, so a summary added on top of its
    exact block would show."""
    lay = awkward_layout()
    q, k, v = qkv(lay, heads=1, seed=6)
    kp = build_plan(q, k, v, lay, SparseConfig(topk_ratio=1.0, tiling="cube", tail="mean", kernel="torch"))
    assert kp.tail is not None
    assert (kp.q2k_num > 0).any()
    assert not kp.summary_mask().any()
    assert (block_sparse_reference(q, k, v, kp)[0] - dense(q, k, v)).abs().max() < TOL
    summaries_only = dataclasses.replace(kp, q2k_idx=kp.q2k_idx[..., :0], q2k_num=torch.zeros_like(kp.q2k_num))
    assert (block_sparse_reference(q, k, v, summaries_only)[0] - dense(q, k, v)).abs().max() > 1e-3


def test_permuting_tokens_and_unpermuting_the_output_changes_nothing():
    lay = awkward_layout()
    q, k, v = qkv(lay, seed=7)
    plan = build_plan(q, k, v, lay, SparseConfig(topk_ratio=0.3, tiling="cube", tail="reweight", kernel="torch"))
    out, lse = block_sparse_reference(q, k, v, plan)
    pi = torch.randperm(lay.total, generator=torch.Generator().manual_seed(8))  # new row r holds old row pi[r]
    inv = torch.argsort(pi).to(torch.int32)
    relabel = lambda p: torch.where(p >= 0, inv[p.clamp(min=0).long()], p)  # noqa: E731
    moved = dataclasses.replace(plan, tiling=dataclasses.replace(plan.tiling, q_perm=relabel(plan.q_perm),
                                                                 k_perm=relabel(plan.k_perm)))
    out2, lse2 = block_sparse_reference(q[:, :, pi], k[:, :, pi], v[:, :, pi], moved)
    assert (out2 - out[:, :, pi]).abs().max() < 1e-13
    assert (lse2 - lse[:, :, pi]).abs().max() < 1e-12


def test_an_empty_allowed_set_yields_zeros_and_a_finite_lse():
    lay = awkward_layout()
    q, k, v = qkv(lay, seed=9)
    kp = build_plan(q, k, v, lay, SparseConfig(tiling="cube", tail="none", kernel="torch"))
    J = kp.num_blocks
    empty = torch.arange(J) % 3 == 0
    kp = dataclasses.replace(kp, dense_hi=torch.where(empty, torch.zeros_like(kp.dense_hi), kp.dense_hi),
                             q2k_num=torch.where(empty.view(1, 1, J), torch.zeros_like(kp.q2k_num), kp.q2k_num))
    out, lse = block_sparse_reference(q, k, v, kp)
    rows = torch.cat([kp.q_perm[0, 0].view(J, -1)[i] for i in range(J) if empty[i]])
    rows = rows[rows >= 0].long()
    assert (out[:, :, rows] == 0).all()
    assert (lse[:, :, rows] == EMPTY_ROW_LSE).all()
    assert torch.isfinite(lse).all()
    assert torch.isfinite(out).all()


def test_sparse_attention_is_deterministic_and_keeps_dtype():
    lay = awkward_layout()
    q, k, v = (x.float() for x in qkv(lay, seed=10))
    cfg = SparseConfig(topk_ratio=0.2, tiling="cube", kernel="torch")
    a, b = sparse_attention(q, k, v, lay, cfg), sparse_attention(q, k, v, lay, cfg)
    assert a.dtype == torch.float32
    assert torch.equal(a, b)


def test_info_reports_density_budgets_and_plan():
    lay = awkward_layout()
    q, k, v = qkv(lay, seed=11)
    out, info = sparse_attention(q, k, v, lay, SparseConfig(topk_ratio=0.25, tiling="cube", kernel="torch",
                                                            sparse_scope="joint-video"), return_info=True)
    assert info.budgets == {"ref_video[37:127]": 1, "video[180:390]": 2}
    assert 0 < info.density < 1
    assert info.kernel == "torch"
    assert info.plan.q2k_idx.dtype == torch.int16  # J < 2**15: the half-width table


@pytest.mark.parametrize("tiling,scope,ratio", [("cube", "joint-video", 0.25), ("reblock", "target-video", 0.1),
                                                ("reblock", "joint-video", 1.0)])
def test_density_counts_the_exact_pairs_of_the_masks(tiling, scope, ratio):
    """The O(J x R) count equals the pairs of the J x J allowed mask weighted by block lengths."""
    lay = awkward_layout()
    q, k, v = qkv(lay, seed=12)
    _, info = sparse_attention(q, k, v, lay, SparseConfig(topk_ratio=ratio, tiling=tiling, sparse_scope=scope,
                                                          kernel="torch"), return_info=True)
    kp = info.plan
    n = kp.block_len.double()
    pairs = (kp.allowed_mask().double() * n.view(-1, 1) * n.view(1, -1)).sum((-1, -2)).mean()
    assert info.density == pytest.approx(float(pairs) / lay.total ** 2, rel=1e-12)


@pytest.mark.parametrize("change,match", [
    (lambda q, k, v: (q[:, :, :-1], k[:, :, :-1], v[:, :, :-1]), "does not match the layout"),
    (lambda q, k, v: (q[..., :24], k[..., :24], v[..., :24]), "head_dim=24"),
    (lambda q, k, v: (q, k[:, :1], v), "same shape"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), "dtype"),
    (lambda q, k, v: (q[0], k[0], v[0]), "\\[B, H, S, D\\]"),
    (lambda q, k, v: (q, k.float(), v), "one dtype"),
])
def test_bad_inputs_raise_clearly(change, match):
    lay = awkward_layout()
    with pytest.raises(ValueError, match=match):
        sparse_attention(*change(*qkv(lay)), lay, SparseConfig(tiling="cube"))


def test_strict_triton_without_a_gpu_raises():
    lay = awkward_layout()
    with pytest.raises(RuntimeError, match="kernel='triton' cannot run"):
        sparse_attention(*qkv(lay), lay, SparseConfig(tiling="cube", kernel="triton", strict=True))
