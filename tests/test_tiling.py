"""Cube tiling: members, edge tiles with true lengths, pack/unpack."""
import torch

from adaptive_sparse_attention import SequenceLayout
from adaptive_sparse_attention.backend.tiling import chunk_tiles, cube_tiles, cube_tiling
from adaptive_sparse_attention.kernels import pack, unpack


def test_block_A_of_grid_444_tile_422():
    members, lengths = cube_tiles((4, 4, 4), (4, 2, 2))
    assert members.shape == (4, 16)  # J = 4 blocks A, B, C, D
    assert members[0].tolist() == [0, 1, 4, 5, 16, 17, 20, 21, 32, 33, 36, 37, 48, 49, 52, 53]
    assert members[1].tolist()[:4] == [2, 3, 6, 7]  # B: top-right
    assert lengths.tolist() == [16, 16, 16, 16]
    # the packed order: A, then B, C, D; every token exactly once
    assert sorted(members.reshape(-1).tolist()) == list(range(64))


def test_edge_tiles_of_grid_534_carry_true_lengths():
    members, lengths = cube_tiles((5, 3, 4), (4, 2, 2))
    # ceil(5/4) * ceil(3/2) * ceil(4/2) = 2 * 2 * 2 = 8 tiles
    assert lengths.tolist() == [16, 16, 8, 8, 4, 4, 2, 2]
    for row, n in zip(members, lengths):
        assert (row[:n] >= 0).all()
        assert (row[n:] == -1).all()  # valid members first
    valid = members[members >= 0]
    assert sorted(valid.tolist()) == list(range(60))
    # the last tile: t=4, y=2, x=2..3 -> 4*12 + 2*4 + 2, +1
    assert members[-1, :2].tolist() == [58, 59]


def test_context_chunks_keep_the_remainder_in_one_edge_block():
    members, lengths = chunk_tiles(150, 64)
    assert lengths.tolist() == [64, 64, 22]
    assert members[2, :22].tolist() == list(range(128, 150))


def test_cube_tiling_of_a_layout_never_crosses_regions():
    lay = SequenceLayout.from_segments([(0, 70, "text"), (70, 100, "audio"), (100, 100 + 5 * 6 * 7, "video", (5, 6, 7))])
    for bs in (64, 128):
        t = cube_tiling(lay, bs)
        perm = t.q_perm.view(-1, bs)
        for (lo, hi), seg in zip(t.region_blocks, t.regions):
            rows = perm[lo:hi]
            rows = rows[rows >= 0]
            assert sorted(rows.tolist()) == list(range(seg.start, seg.stop))
        assert t.block_len.sum().item() == lay.total
        assert (t.block_len == (perm >= 0).sum(1)).all()


def test_pack_unpack_round_trip_with_per_head_permutations():
    torch.manual_seed(0)
    S, L = 37, 48
    perms = torch.stack([torch.cat([torch.randperm(S), torch.full((L - S,), -1)])[torch.randperm(L)] for _ in range(3)])
    x = torch.randn(2, 3, S, 5, dtype=torch.float64)
    packed = pack(x, perms.view(1, 3, L).int())
    assert (packed[:, perms < 0] == 0).all()
    assert torch.equal(unpack(packed, perms.view(1, 3, L).int(), S), x)

