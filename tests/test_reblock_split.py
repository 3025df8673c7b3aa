"""Fused split-and-move kernel of the reblock tree (CPU interpreter) against the torch levels.

The partition is run twice on the same features: all levels on the torch path, and with the
fused kernel for every node up to a width (all of them, or only the narrow, deep levels so the
two paths alternate). The tilings must be identical: the selection is an exact rank rule
(capacity-many smallest projections, ties by slot), so there is no tolerance. Features include
full ties, three-valued ones, -0.0 next to 0.0, edge blocks and a single-block region.
"""
import pytest
import torch

from triton_interpreter import interpreter_env

with interpreter_env():
    pytest.importorskip("triton")
    from adaptive_sparse_attention.kernels import reblock_split

from adaptive_sparse_attention.backend import reblock
from adaptive_sparse_attention.backend.reblock import build_schedule, partition

pytestmark = pytest.mark.usefixtures("interpreter")


def features(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(4, n, 4, generator=g)
    z[1] = 0  # every projection ties
    z[2, :, 1:] = 0
    z[2, :, 0] = (torch.arange(n) % 3).float()  # three distinct values
    z[3, ::2] = -0.0
    return z


@pytest.mark.parametrize("n,bs,max_width", [(600, 16, 4096), (600, 16, 100), (97, 8, 4096), (5, 16, 4096)])
def test_fused_levels_give_the_torch_tiling(monkeypatch, n, bs, max_width):
    z = features(n, seed=n + bs)
    schedule = build_schedule(n, bs, torch.device("cpu"))
    want = partition(z, schedule)
    monkeypatch.setattr(reblock, "fused_planner", lambda *xs: True)
    monkeypatch.setattr(reblock_split, "MAX_WIDTH", max_width)
    got = partition(z, schedule)
    assert torch.equal(got, want)


def test_too_wide_a_node_is_named():
    with pytest.raises(ValueError, match="node width 9000"):
        reblock_split.split_move_triton(torch.zeros(1, 1, 9000), torch.zeros(1, 1, 2, 9000),
                                        torch.zeros(1, 1, 9000, dtype=torch.int32),
                                        torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 10, True)
