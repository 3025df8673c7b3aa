"""Per-head tiling choice (`backend/head_choice.py`): snake tubes, block log-masses, the pick.

Block log-masses are checked against a float64 loop over blocks (torch path: same float64
inputs, so 1e-12), and the Triton kernel in the interpreter against the torch path on fp32
inputs ("ieee" products in another order: 1e-4 on log-masses of order 10, about 100 ulp of the
fp32 sums). The choice is checked by its rule (every head takes the candidate with the largest
share, the tree on ties) and by its purpose on a structured scene (recall at 10% above the tree's:
0.805 vs 0.775 here).
"""
import math

import pytest
import torch

from triton_interpreter import kernel_imports

with kernel_imports():
    triton = pytest.importorskip("triton")
    from adaptive_sparse_attention.kernels.triton import block_mass

from adaptive_sparse_attention.backend import head_choice
from adaptive_sparse_attention.backend.config import SparseConfig
from adaptive_sparse_attention.backend.layout import SequenceLayout
from adaptive_sparse_attention.bench.metrics import plan_mass_metrics, sample_rows
from adaptive_sparse_attention.backend.planner import build_plan
from adaptive_sparse_attention.backend.reblock import reblock_tiling
from adaptive_sparse_attention.backend.routing import region_budget
from adaptive_sparse_attention.bench.scenes import SceneSize, make_scene
from adaptive_sparse_attention.backend.tiling import chunk_tiles, snake_tiles


def test_snake_tiles_worked_example():
    # grid (T, H, W) = (4, 2, 4), (1, 2) patches, 4-row blocks: patch (h0, w0-1) forwards in time,
    # then (h0, w2-3) backwards, then row h1 right to left: (h1, w2-3) forwards, (h1, w0-1) backwards
    members, lengths = snake_tiles((4, 2, 4), (1, 2), 4)
    assert members[:4].tolist() == [[0, 1, 8, 9], [16, 17, 24, 25], [26, 27, 18, 19], [10, 11, 2, 3]]
    assert members[4:6].tolist() == [[6, 7, 14, 15], [22, 23, 30, 31]]
    assert lengths.tolist() == [4] * 8


@pytest.mark.parametrize("grid,patch,bs", [((5, 3, 7), (1, 2), 8), ((37, 6, 10), (2, 4), 64), ((3, 1, 1), (1, 2), 4)])
def test_snake_tiles_are_a_chunking_of_the_grid(grid, patch, bs):
    members, lengths = snake_tiles(grid, patch, bs)
    n = grid[0] * grid[1] * grid[2]
    want_members, want_lengths = chunk_tiles(n, bs)
    assert torch.equal(lengths, want_lengths)
    assert torch.equal(members < 0, want_members < 0)
    assert torch.equal(members[members >= 0].sort().values, torch.arange(n))
    # every block stays within two neighbouring patches (one where a patch's frames do not run out)
    rest = members.clamp(min=0) % (grid[1] * grid[2])
    h, w = rest // grid[2] // patch[0], rest % grid[2] // patch[1]
    for j in range(len(lengths)):
        live = members[j] >= 0
        assert (h[j][live].max() - h[j][live].min()) <= 1
        assert (w[j][live].max() - w[j][live].min()) <= 1


def loop_log_mass(probes, k, perm, bs):
    G, P, D = probes.shape
    out = torch.empty(G, P, perm.shape[-1] // bs, dtype=torch.float64)
    for g in range(G):
        ids = perm[0 if perm.shape[0] == 1 else g]
        for j in range(out.shape[-1]):
            rows = ids[j * bs:(j + 1) * bs]
            rows = rows[rows >= 0].long()
            out[g, :, j] = torch.logsumexp(probes[g].double() @ k[g, rows].double().T * D ** -0.5, -1)
    return out


def awkward_perms(S, bs, G, gen):
    """A shared and a per-head permutation of S rows in blocks of bs, edge block padded with -1."""
    n = -(-S // bs) * bs
    pad = torch.full((n - S,), -1, dtype=torch.int32)
    shared = torch.cat([torch.randperm(S, generator=gen).to(torch.int32), pad]).view(1, n)
    own = torch.stack([torch.cat([torch.randperm(S, generator=gen).to(torch.int32), pad]) for _ in range(G)])
    return shared, own


def test_block_log_mass_matches_a_loop_over_blocks():
    gen = torch.Generator().manual_seed(3)
    probes, k = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64), torch.randn(3, 45, 8, generator=gen, dtype=torch.float64)
    for perm in awkward_perms(45, 16, 3, gen):
        got = head_choice.block_log_mass(probes, k, perm, 16)
        torch.testing.assert_close(got, loop_log_mass(probes, k, perm, 16), rtol=0, atol=1e-12)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("G,S,D,bs", [(2, 77, 32, 16), (1, 130, 24, 32)])
def test_block_log_mass_kernel_matches_torch(G, S, D, bs):
    gen = torch.Generator().manual_seed(S)
    probes = torch.randn(G, 16, D, generator=gen) * 2
    k = torch.randn(G, S + 3, D, generator=gen)[:, 2:S + 2] * 2  # strided heads
    for perm in awkward_perms(S, bs, G, gen):
        got = block_mass.block_log_mass_triton(probes, k, perm[:, : perm.shape[1] - bs], bs)  # a window, as used
        want = head_choice.block_log_mass(probes, k, perm[:, : perm.shape[1] - bs], bs)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("n,budget", [(37, 4), (300, 30), (16, 16), (5, 1), (70, 64)])  # 37, 70: head and tail
def test_top_share_kernel_matches_torch(n, budget):
    """fp32 rows with ties and -inf (empty) blocks, against the torch path in float64."""
    gen = torch.Generator().manual_seed(n)
    lm = torch.randn(3, 2, 5, n, generator=gen) * 4
    lm[0, 0, 0, : n // 2] = 1.5  # ties across the budget's edge
    lm[1, 1, 2, 1::3] = float("-inf")
    got = block_mass.top_share_triton(lm, budget)
    want = (lm.double().topk(budget, -1).values - lm.double().logsumexp(-1, keepdim=True)).exp().sum(-1)
    assert got.shape == (3, 2, 5)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match=f"budget={n + 1} is not allowed"):
        block_mass.top_share_triton(lm, n + 1)
    with pytest.raises(ValueError, match="log_mass.dtype=torch.float64 is not allowed"):
        block_mass.top_share_triton(lm.double(), budget)


def test_block_log_mass_kernel_names_bad_sizes():
    with pytest.raises(ValueError, match="probes=12 is not allowed"):
        block_mass.block_log_mass_triton(torch.zeros(1, 12, 16), torch.zeros(1, 32, 16),
                                         torch.zeros(1, 32, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="perm must be int32"):
        block_mass.block_log_mass_triton(torch.zeros(1, 16, 16), torch.zeros(1, 32, 16),
                                         torch.zeros(1, 32, dtype=torch.int64), 16)


def small_scene(heads=4):
    """A `cuts` scene whose first two heads take tubes and the others the tree at block 64."""
    return make_scene("cuts", SceneSize(64, 30, (24, 8, 12), heads, 128), seed=1)


def test_every_head_takes_the_candidate_with_the_largest_share():
    sc = small_scene()
    q, k, layout = sc.q, sc.k, sc.layout
    tree = reblock_tiling(q, k, layout, 64, tubes=False)
    chosen = reblock_tiling(q, k, layout, 64, ratio=0.1)
    tubes = head_choice.tube_perms(layout, 64, q.device)
    lo, hi = tree.blocks_of("target_video")
    probes = q.index_select(2, head_choice.probe_rows(layout))[0]
    candidates = [tree.k_perm[0]] + [t.expand(q.shape[1], -1) for t in tubes]
    share = torch.stack([head_choice.top_share(head_choice.block_log_mass(probes, k[0], c[:, lo * 64:hi * 64], 64),
                                               region_budget(hi - lo, 0.1)) for c in candidates])
    picks = []
    for h in range(q.shape[1]):
        best = int(share[:, h].argmax())
        picks.append(best)
        assert torch.equal(chosen.k_perm[0, h], candidates[best][h])
        assert torch.equal(chosen.q_perm[0, h], chosen.k_perm[0, h])
    assert picks[:2] != [0, 0]
    assert picks[2:] == [0, 0]  # heads 0, 1 (local, temporal) take tubes


def test_ties_keep_the_tree():
    """Target-video keys of zero give every key block of every candidate the same log-mass
    (log 64: the 36 target blocks are full), so all candidates hold exactly R / 36 of the mass at
    ratio 0.1 and the rule must break the tie: the tree, the first candidate, stays. With the
    scene's own keys the same call moves heads 0 and 1 to tubes, so the tie decides."""
    sc = small_scene(heads=2)
    q, k, layout = sc.q, sc.k, sc.layout
    tree = reblock_tiling(q, k, layout, 64, tubes=False)
    lo, hi = tree.blocks_of("target_video")
    flat = k.clone()
    flat[:, :, layout.target.start:layout.target.stop] = 0
    tubes = head_choice.tube_perms(layout, 64, q.device)
    probes = q.index_select(2, head_choice.probe_rows(layout))[0]
    candidates = [tree.k_perm[0]] + [t.expand(q.shape[1], -1) for t in tubes]
    share = torch.stack([head_choice.top_share(head_choice.block_log_mass(probes, flat[0], c[:, lo * 64:hi * 64], 64),
                                               region_budget(hi - lo, 0.1)) for c in candidates])
    assert hi - lo == 36
    assert torch.equal(share, share[:1].expand_as(share))  # an exact tie, every head
    assert all(not torch.equal(tree.k_perm[0, h], t) for h in range(q.shape[1]) for t in tubes)  # tubes differ
    span = (lo, hi)
    kept = head_choice.choose_tubes(q, flat, tree.k_perm.unsqueeze(0), layout, 64, span, 0.1)
    assert torch.equal(kept[0], tree.k_perm)
    moved = head_choice.choose_tubes(q, k, tree.k_perm.unsqueeze(0), layout, 64, span, 0.1)
    assert not torch.equal(moved[0, 0, 0], tree.k_perm[0, 0])
    assert not torch.equal(moved[0, 0, 1], tree.k_perm[0, 1])


def test_independent_layouts_follow_the_key_choice():
    sc = small_scene()
    tree = reblock_tiling(sc.q, sc.k, sc.layout, 64, "independent", tubes=False)
    chosen = reblock_tiling(sc.q, sc.k, sc.layout, 64, "independent")
    for h in range(sc.q.shape[1]):
        kept = torch.equal(chosen.k_perm[0, h], tree.k_perm[0, h])
        assert kept == torch.equal(chosen.q_perm[0, h], tree.q_perm[0, h])
        if not kept:
            assert torch.equal(chosen.q_perm[0, h], chosen.k_perm[0, h])


def test_choice_raises_recall_on_a_structured_scene():
    sc = small_scene()
    q, k, v, layout = sc.q, sc.k, sc.v, sc.layout
    rows = sample_rows(layout, 64, 0)["video"]
    cfg = SparseConfig(topk_ratio=0.1, tail="none", min_tokens=0, block_size=64)

    def recall(tiling):
        return float(plan_mass_metrics(q, k, build_plan(q, k, v, layout, cfg, tiling=tiling), rows)[0].mean())

    assert recall(reblock_tiling(q, k, layout, 64)) > recall(reblock_tiling(q, k, layout, 64, tubes=False)) + 0.01


def test_probe_rows_lie_in_the_target_video():
    layout = SequenceLayout.from_segments([(0, 10, "text"), (10, 10 + 2 * 12, "video", (2, 3, 4))])
    rows = head_choice.probe_rows(layout)
    assert rows.min() >= 10
    assert rows.max() < 34
    assert math.isclose(float(rows.float().mean()), 22, abs_tol=3)
