"""The one plan (kernels/plan.py).

The plan is frozen and checks itself from metadata when it is made, so a malformed plan fails
where it is built, naming the field, instead of inside a kernel.
"""
import dataclasses

import pytest
import torch

from adaptive_sparse_attention.kernels import BlockSparsePlan, BlockSummaries, QuerySummaries, RoutingGroup, Tiling
J, BS, B, H, R, D = 3, 4, 1, 2, 2, 8


def parts() -> dict:
    perm = torch.arange(J * BS, dtype=torch.int32).view(1, 1, -1)
    return dict(tiling=Tiling(BS, perm, perm, torch.full((J,), BS, dtype=torch.int32)),
                dense_hi=torch.tensor([J, 1, 1], dtype=torch.int32),
                q2k_idx=torch.tensor([[-1, -1], [1, 2], [2, -1]], dtype=torch.int16).expand(B, H, J, R).contiguous(),
                q2k_num=torch.tensor([0, 2, 1], dtype=torch.int32).expand(B, H, J).contiguous(),
                groups=((1, 3, 2),))


def test_a_plan_exposes_its_tiling_and_is_frozen():
    plan = BlockSparsePlan(**parts())
    assert plan.block_size == BS
    assert plan.num_blocks == J
    assert plan.q_perm is plan.tiling.q_perm
    assert plan.k_perm is plan.tiling.k_perm
    assert plan.block_len is plan.tiling.block_len
    assert plan.tail is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.dense_hi = plan.dense_hi  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tiling.block_size = 8  # type: ignore[misc]


@pytest.mark.parametrize("field,value,named", [
    ("dense_hi", torch.zeros(J, dtype=torch.int64), "dense_hi"),
    ("dense_hi", torch.zeros(J + 1, dtype=torch.int32), "dense_hi"),
    ("q2k_idx", torch.zeros(B, H, J, R, dtype=torch.int64), "q2k_idx"),
    ("q2k_idx", torch.zeros(B, H, J + 1, R, dtype=torch.int32), "q2k_idx"),
    ("q2k_num", torch.zeros(B, H + 1, J, dtype=torch.int32), "q2k_num"),
    ("q2k_num", torch.zeros(B, H, J, dtype=torch.float32), "q2k_num"),
    ("groups", ((0, J + 1, 1),), "groups"),
    ("groups", [(1, 3, 2)], "groups"),
    ("tail", "reweight", "tail"),
    ("tail", QuerySummaries(torch.zeros(B, H, J, D), torch.zeros(B, H, J, D), torch.zeros(B, H, J + 1)), "query summaries"),
    ("tail", BlockSummaries(torch.zeros(B, H, J), torch.zeros(B, H + 1, J, D)), "block summaries"),
    ("tiling", "cube", "tiling"),
])
def test_a_malformed_plan_names_its_field(field, value, named):
    with pytest.raises(ValueError, match=named):
        BlockSparsePlan(**{**parts(), field: value})


def test_a_plan_takes_either_tail_and_per_head_permutations():
    p = parts()
    per_head = torch.arange(J * BS, dtype=torch.int32).expand(B, H, -1).contiguous()
    tiling = Tiling(BS, per_head, per_head, p["tiling"].block_len)
    BlockSparsePlan(**{**p, "tiling": tiling, "tail": QuerySummaries(torch.zeros(B, H, J, D), torch.zeros(B, H, J, D),
                                                                     torch.zeros(B, H, J))})
    BlockSparsePlan(**{**p, "tail": BlockSummaries(torch.zeros(B, H, J), torch.zeros(B, H, J, D))})
    with pytest.raises(ValueError, match="tiling.q_perm"):
        three = torch.arange(J * BS, dtype=torch.int32).expand(B, H + 1, -1).contiguous()
        BlockSparsePlan(**{**p, "tiling": Tiling(BS, three, three, p["tiling"].block_len)})


@pytest.mark.parametrize("kwargs,named", [
    (dict(block_size=0), "block_size"),
    (dict(block_len=torch.full((J,), BS, dtype=torch.int64)), "block_len"),
    (dict(q_perm=torch.zeros(1, 1, J * BS - 1, dtype=torch.int32)), "q_perm"),
    (dict(k_perm=torch.zeros(1, 1, J * BS, dtype=torch.int64)), "k_perm"),
    (dict(region_blocks=((0, 1), (2, J)), regions=("a", "b")), "region_blocks"),
    (dict(region_blocks=((0, J),)), "regions"),
])
def test_a_malformed_tiling_names_its_field(kwargs, named):
    perm = torch.arange(J * BS, dtype=torch.int32).view(1, 1, -1)
    base = dict(block_size=BS, q_perm=perm, k_perm=perm, block_len=torch.full((J,), BS, dtype=torch.int32))
    with pytest.raises(ValueError, match=named):
        Tiling(**{**base, **kwargs})




def test_the_plan_prints_short_and_names_its_groups():
    plan = BlockSparsePlan(**parts())
    text = repr(plan)
    assert "tensor(" not in text
    assert len(text) < 200
    assert f"J={J}" in text
    assert "[1:3] top 2" in text
    assert plan.groups == (RoutingGroup(1, 3, 2),)
    assert plan.groups[0].budget == 2


def test_density_counts_the_exact_pairs():
    plan = BlockSparsePlan(**parts())
    n = plan.block_len.double()
    allowed = plan.allowed_mask().double()  # [B, H, J, J]
    want = float((allowed * n.view(-1, 1) * n.view(1, -1)).sum((-1, -2)).mean() / n.sum() ** 2)
    assert plan.density() == pytest.approx(want, rel=1e-12)
    assert 0 < want < 1


@pytest.mark.parametrize("tail", ["none", "query", "block"])
def test_flatten_and_unflatten_give_the_same_plan(tail):
    base = parts()
    if tail == "query":
        base["tail"] = QuerySummaries(torch.zeros(B, H, J, D), torch.zeros(B, H, J, D), torch.zeros(B, H, J))
    elif tail == "block":
        base["tail"] = BlockSummaries(torch.zeros(B, H, J), torch.zeros(B, H, J, D))
    plan = BlockSparsePlan(**base)
    tensors, block_size, groups, kind = plan.flatten()
    assert kind == tail
    assert all(isinstance(t, torch.Tensor) for t in tensors)
    again = BlockSparsePlan.unflatten(tensors, block_size, groups, kind)
    assert again.groups == plan.groups
    assert again.block_size == plan.block_size
    assert type(again.tail) is type(plan.tail)
    for a, b in zip(again.flatten()[0], tensors):
        assert a is b
