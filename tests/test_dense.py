"""Dense blocks on the fastest exact kernel: the measured choice, its cache and the override.

The candidates themselves need a GPU (bench/e2e.py measures them); here the choice logic runs
with fake timings, and the override is held to an independent float64 softmax attention.
"""
from __future__ import annotations

import json

import pytest
import torch

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.nodes.block_patches import BlockReplacement
from adaptive_sparse_attention.nodes.dense_override import DenseOverride
from adaptive_sparse_attention.nodes.hooks import CallContext
from adaptive_sparse_attention.nodes.sparse_hook import SparseAttentionHook
from adaptive_sparse_attention.kernels import dense


def test_fastest_takes_the_quickest_agreeing_candidate():
    outputs = {"cudnn": torch.ones(4), "flash": torch.ones(4) * (1 + 1e-3), "efficient": torch.ones(4) * 1.5}
    times = iter([3.0, 2.0, 1.0])
    assert dense.fastest(dense.CANDIDATES, outputs.__getitem__, lambda fn: next(times)) == "flash"


def test_fastest_skips_candidates_that_cannot_run_and_breaks_ties_by_order():
    def run(name):
        if name == "cudnn":
            raise RuntimeError("No available kernel")
        return torch.ones(3)

    assert dense.fastest(dense.CANDIDATES, run, lambda fn: 1.0) == "flash"

    def never(name):
        raise RuntimeError("No available kernel")

    assert dense.fastest(dense.CANDIDATES, never, lambda fn: 1.0) is None


def test_cached_choice_measures_once_per_key_and_machine(tmp_path, monkeypatch):
    path = tmp_path / "choices.json"
    monkeypatch.setenv(dense.CACHE_ENV, str(path))
    monkeypatch.setattr(dense, "_choices", {})
    measured = []
    assert dense.cached_choice("gpu|bf16|D128", lambda: measured.append(1) or "cudnn") == "cudnn"
    assert dense.cached_choice("gpu|bf16|D128", lambda: measured.append(1) or "flash") == "cudnn"
    assert json.loads(path.read_text()) == {"gpu|bf16|D128": "cudnn"}
    monkeypatch.setattr(dense, "_choices", {})  # a new process reads the file instead of measuring
    assert dense.cached_choice("gpu|bf16|D128", lambda: measured.append(1) or "flash") == "cudnn"
    assert measured == [1]
    path.write_text('{"gpu|bf16|D128": "no-such-kernel"}')  # a damaged entry is measured again
    monkeypatch.setattr(dense, "_choices", {})
    assert dense.cached_choice("gpu|bf16|D128", lambda: "efficient") == "efficient"


def test_wide_strided_rows_never_reach_the_memory_efficient_kernel(tmp_path, monkeypatch):
    S, H, D = 221446, 56, 128  # H3 at 30 s: ComfyUI's q/k are views of the [S, 3*H*D] qkv buffer
    comfy = torch.empty_strided((1, H, S, D), (H * D, D, 3 * H * D, 1), device="meta")
    packed = torch.empty((1, H, S, D), device="meta")
    assert dense.wide_rows(comfy) and not dense.wide_rows(packed)
    assert dense.candidates(comfy, comfy, packed) == ("cudnn", "flash")
    assert dense.candidates(packed, packed, packed) == dense.CANDIDATES
    ten_s = torch.empty_strided((1, H, 73642, D), (H * D, D, 3 * H * D, 1), device="meta")
    assert not dense.wide_rows(ten_s)  # 1.58e9 elements: below the limit
    # a choice saved for the key must be one the inputs allow, else it is measured again
    path = tmp_path / "choices.json"
    monkeypatch.setenv(dense.CACHE_ENV, str(path))
    monkeypatch.setattr(dense, "_choices", {})
    path.write_text('{"k|wide rows": "efficient"}')
    assert dense.cached_choice("k|wide rows", lambda: "cudnn", ("cudnn", "flash")) == "cudnn"


def test_cpu_runs_sdpa_default():
    q = torch.randn(1, 2, 5, 8)
    assert dense.dense_choice(q, q, q) is None


def exact_attention(q, k, v):
    """Softmax attention in float64, [B, H, S, D]."""
    w = torch.softmax(q.double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5, -1)
    return w @ v.double()


@pytest.mark.parametrize("skip_reshape", [True, False])
@pytest.mark.parametrize("skip_output_reshape", [True, False])
def test_override_computes_exact_attention_in_comfyui_shapes(skip_reshape, skip_output_reshape):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 37, 16, generator=g) for _ in range(3))
    ref = exact_attention(q, k, v)
    args = (q, k, v) if skip_reshape else tuple(t.transpose(1, 2).reshape(1, 37, 48) for t in (q, k, v))

    def comfy_attention(*a, **kw):
        raise AssertionError("the override serves this call itself")

    out = DenseOverride()(comfy_attention, *args, 3, skip_reshape=skip_reshape,
                            skip_output_reshape=skip_output_reshape, transformer_options={}, _inside_attn_wrapper=True)
    if not skip_output_reshape:
        out = out.view(1, 37, 3, 16).transpose(1, 2)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-6)  # fp32 SDPA against float64


def test_override_hands_masked_calls_to_comfyui():
    calls = []
    q = torch.randn(1, 2, 4, 8)
    DenseOverride()(lambda *a, **kw: calls.append(kw) or q, q, q, q, 2, mask=torch.zeros(4, 4), skip_reshape=True,
                    transformer_options={}, _inside_attn_wrapper=True)
    assert calls and calls[0]["mask"] is not None and calls[0]["_inside_attn_wrapper"]


@pytest.mark.parametrize("setting,other,expected", [
    ("fastest", None, "ours"), ("comfyui", None, None), ("fastest", "theirs", "theirs")])
def test_dense_blocks_get_the_override(setting, other, expected):
    hook = SparseAttentionHook(SparseConfig(warmup_mode="dense", dense_attention=setting))
    model = torch.nn.Module()
    model.blocks = [torch.nn.Module()]
    model.blocks[0].attn = torch.nn.Module()
    replacement = BlockReplacement(hook.key, 0, via_args=True, previous=None)
    to = {"sigmas": torch.tensor([1.0]), "sample_sigmas": torch.tensor([1.0, 0.0])}
    to[hook.key] = CallContext(hook, model, *hook.tracker.step_of(to))
    if other is not None:
        to["optimized_attention_override"] = other
    seen = []
    args = {"img": torch.zeros(3, 4), "transformer_options": to}
    replacement(args, {"original_block": lambda a: seen.append(a["transformer_options"]) or a})
    assert seen[0].get("optimized_attention_override") is (hook.dense_override if expected == "ours" else expected)
    assert to.get("optimized_attention_override") is other  # the caller's options are not changed
