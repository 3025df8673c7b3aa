"""Tail summaries: exact numbers and the q = anchor property."""
import math

import numpy as np
import pytest
import torch

from adaptive_sparse_attention.backend.layout import SequenceLayout
from adaptive_sparse_attention.backend.tail import mean_summaries, reweight_summaries
from adaptive_sparse_attention.backend.tiling import Tiling
from adaptive_sparse_attention.kernels import BlockSparsePlan, QuerySummaries, block_sparse_reference


def chunk_tiling(n: int, block: int) -> Tiling:
    """Contiguous blocks of `block` rows (the seed's teaching layout), all of one video region."""
    lay = SequenceLayout.from_segments([(0, n, "video", (1, 1, n))])
    perm = torch.arange(n, dtype=torch.int32).view(1, 1, n)
    J = n // block
    return Tiling(block, perm, perm, torch.full((J,), block, dtype=torch.int32), tuple(lay.regions()), ((0, J),))


def test_two_token_block():
    """The seed's worked example: keys (-2, 2), values (0, 1), anchor 1, head dim 1.

    The anchor weighs the keys by softmax(k) = (e^-2, e^2) / (e^-2 + e^2), so the summary key is
    the weighted key 2 tanh 2, the value the weighted value e^2 / (e^-2 + e^2) = sigmoid(4), and the
    bias makes exp(key + bias) the block's true mass e^-2 + e^2 = 2 cosh 2 at the anchor."""
    k = torch.tensor([-2.0, 2.0], dtype=torch.float64).view(1, 1, 2, 1)
    v = torch.tensor([0.0, 1.0], dtype=torch.float64).view(1, 1, 2, 1)
    anchor = torch.ones(1, 1, 1, dtype=torch.float64)
    key, value, bias = reweight_summaries(k, v, chunk_tiling(2, 2), anchor)
    assert key.item() == pytest.approx(2 * math.tanh(2), rel=1e-12)
    assert value.item() == pytest.approx(1 / (1 + math.exp(-4)), rel=1e-12)
    assert bias.item() == pytest.approx(math.log(2 * math.cosh(2)) - 2 * math.tanh(2), rel=1e-12)
    # the source document's printed values (six decimals)
    assert key.item() == pytest.approx(1.928055, abs=5e-7)
    assert value.item() == pytest.approx(0.982014, abs=5e-7)
    assert bias.item() == pytest.approx(0.090095, abs=5e-7)
    assert math.exp(key.item() + bias.item()) == pytest.approx(math.exp(-2) + math.exp(2), rel=1e-12)
    # the mean summary keeps the count (+log 2) but still misses the Jensen gap: mass 2, value 0.5
    mk, mv, mb = mean_summaries(k, v, chunk_tiling(2, 2))
    assert math.exp(mk.item() + mb.item()) == pytest.approx(2.0)
    assert mv.item() == pytest.approx(0.5)


def _mixed(tail: str) -> float:
    """32 keys in blocks of 4, exact blocks {1, 5}, query = anchor (the tails' mixed case)."""
    rng = np.random.default_rng(20261024)
    k = torch.from_numpy(rng.normal(size=(32, 8))).view(1, 1, 32, 8)
    v = torch.from_numpy(rng.normal(size=(32, 5)))
    a = torch.from_numpy(rng.normal(size=8))
    # values have 5 columns and keys 8: pad values to 8 columns, compare the first 5
    v8 = torch.cat([v, torch.zeros(32, 3, dtype=torch.float64)], 1).view(1, 1, 32, 8)
    tiling = chunk_tiling(32, 4)
    if tail == "reweight":
        key, value, bias = reweight_summaries(k, v8, tiling, a.view(1, 1, 8))
    else:
        key, value, bias = mean_summaries(k, v8, tiling)
    q = a.view(1, 1, 1, 8).expand(1, 1, 32, 8).contiguous()  # every query is the anchor
    J = 8
    plan = BlockSparsePlan(tiling, torch.zeros(J, dtype=torch.int32),
                           torch.tensor([1, 5], dtype=torch.int32).expand(1, 1, J, 2).contiguous(),
                           torch.full((1, 1, J), 2, dtype=torch.int32), tail=QuerySummaries(key, value, bias))
    out, _ = block_sparse_reference(q, k, v8, plan)
    dense = torch.softmax(a @ k[0, 0].T / math.sqrt(8), -1) @ v
    return (out[0, 0, :, :5] - dense).abs().max().item()


def test_mixed_exact_and_reweight_summaries_reproduce_dense_at_the_anchor():
    assert _mixed("reweight") < 1e-12


def test_mean_summaries_do_not_reproduce_dense_at_the_anchor():
    """Plain means lose the Jensen gap, so the error at the anchor stays of the order of the values
    (they are standard normal), far above float64 rounding and the reweighted tail's error."""
    mean, reweight = _mixed("mean"), _mixed("reweight")
    assert mean > 1e-2
    assert mean > 1e6 * max(reweight, 1e-18)
