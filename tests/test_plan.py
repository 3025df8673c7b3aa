"""The one plan (kernels/plan.py) and the one dispatch (kernels/dispatch.py).

The plan is frozen and checks itself from metadata when it is made, so a malformed plan fails
where it is built, naming the field, instead of inside a kernel. The dispatch resolves
`config.backend` from the device and dtype alone (a CUDA device object needs no GPU here).
"""
import dataclasses
import importlib.util
import logging
import os

import pytest
import torch

from adaptive_sparse_attention import SequenceLayout, SparseConfig, sparse_attention
from adaptive_sparse_attention.kernels import cudnn_attention
from adaptive_sparse_attention.kernels import (BACKENDS, BlockSparsePlan, BlockSummaries, QuerySummaries, Tiling,
                                             block_sparse_attention, resolve_backend)

HAS_TRITON = importlib.util.find_spec("triton") is not None
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
    assert plan.block_size == BS and plan.num_blocks == J and plan.q_perm is plan.tiling.q_perm
    assert plan.k_perm is plan.tiling.k_perm and plan.block_len is plan.tiling.block_len and plan.tail is None
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


def test_auto_picks_by_device_and_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, torch.float32) == "torch"
    assert resolve_backend("auto", cuda, torch.float64) == "torch"  # the one dtype contract: no fp64 Triton
    assert resolve_backend("auto", cuda, torch.bfloat16) == ("triton" if HAS_TRITON else "torch")
    assert resolve_backend("torch", cuda, torch.bfloat16) == "torch"
    mps = torch.device("mps")  # any other device: the torch reference, by auto and as the fallback
    assert resolve_backend("auto", mps, torch.float32) == "torch"
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert resolve_backend("triton", mps, torch.float32) == "torch"
    with pytest.raises(ValueError, match="backend='rocm'"):
        resolve_backend("rocm", cpu, torch.float32)
    with pytest.raises(ValueError, match="backend='rocm'"):
        block_sparse_attention(*(torch.zeros(1),) * 3, BlockSparsePlan(**parts()), "rocm")
    assert tuple(BACKENDS) == ("cudnn", "triton", "torch")


def test_the_cudnn_backend_runs_only_where_asked_for_and_able(monkeypatch, caplog):
    """Its rule, with the package and the GPU made present: sm90, fp16/bf16, head_dim 64/128 and
    block size 64; `auto` never takes it; asked for by name where it cannot run it says why and
    runs the next backend (strict mode raises)."""
    cuda = torch.device("cuda")
    if not HAS_TRITON:
        pytest.skip("the cuDNN backend needs Triton")
    if importlib.util.find_spec("cudnn") is None:
        with pytest.raises(RuntimeError, match="nvidia-cudnn-frontend .* not installed.*strict"):
            resolve_backend("cudnn", cuda, torch.bfloat16, strict=True)
        with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
            assert resolve_backend("cudnn", cuda, torch.bfloat16) == "triton"
        assert any("using backend='triton' instead" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(cudnn_attention, "_missing_package", lambda: None)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert resolve_backend("cudnn", cuda, torch.bfloat16, True, head_dim=128, block_size=64) == "cudnn"
    assert resolve_backend("cudnn", cuda, torch.float16, True) == "cudnn"  # head_dim and block size not known yet
    assert resolve_backend("auto", cuda, torch.bfloat16, head_dim=128, block_size=64) == "triton"
    for kwargs, named in ((dict(dtype=torch.float32), "float32"), (dict(head_dim=96), "head_dim 96"),
                          (dict(block_size=128), "block_size 128")):
        args = dict(dtype=torch.bfloat16, head_dim=128, block_size=64) | kwargs
        assert named in cudnn_attention.cudnn_unavailable_reason(cuda, **args)
        with pytest.raises(RuntimeError, match=named):
            resolve_backend("cudnn", cuda, strict=True, **args)
        assert resolve_backend("cudnn", cuda, **args) == "triton"  # the next backend that runs
    capability[0] = (8, 6)
    assert "sm86 is not enabled" in cudnn_attention.cudnn_unavailable_reason(cuda, torch.bfloat16)
    assert resolve_backend("cudnn", cuda, torch.bfloat16) == "triton"
    assert "cpu" in cudnn_attention.cudnn_unavailable_reason(torch.device("cpu"), torch.bfloat16)


def test_a_named_backend_that_cannot_run_raises_in_strict_mode_and_says_so_otherwise(caplog):
    cuda = torch.device("cuda")
    with pytest.raises(RuntimeError, match=r"backend='triton' cannot run: .*(float64|not installed).*strict"):
        resolve_backend("triton", cuda, torch.float64, strict=True)
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        assert resolve_backend("triton", cuda, torch.float64) == "torch"
    assert any("torch reference" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton, to prove it is never launched")
def test_the_torch_backend_runs_every_kernel_in_torch(monkeypatch):
    """backend="torch" never reaches a Triton launcher, planner included (reblock, query tail),
    even where Triton could run (its interpreter is on)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def refuse(self, *args, **kwargs):
        pytest.fail(f"Triton kernel {getattr(self, '__name__', self)} launched on the torch backend")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(JITFunction, "run", refuse)
    monkeypatch.setattr(InterpretedFunction, "run", refuse)
    layout = SequenceLayout.from_segments([(0, 20, "text"), (20, 20 + 3 * 8 * 8, "video", (3, 8, 8))])
    q, k, v = (torch.randn(1, 2, layout.total, 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    config = SparseConfig(backend="torch", min_tokens=0)
    with pytest.raises(pytest.fail.Exception, match="launched on the torch backend"):  # the guard sees Triton
        sparse_attention(q, k, v, layout, config.replace(backend="triton"))
    out, info = sparse_attention(q, k, v, layout, config, return_info=True)
    assert info.backend == "torch" and isinstance(info.plan, BlockSparsePlan) and isinstance(info.plan.tail,
                                                                                               QuerySummaries)
