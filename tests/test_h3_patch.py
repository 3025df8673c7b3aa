"""The H3 block patch on a tiny H3-shaped model built from the documented block contract.

Everything runs in float64 on the CPU with the torch reference kernel, so the patched blocks
must match their oracles to ~1e-12 (only summation order differs).
"""
from __future__ import annotations

import logging

import pytest
import torch

from adaptive_sparse_attention.backend import producer
from adaptive_sparse_attention.nodes import core_sparse, h3_model, preparation, sparse_call
from adaptive_sparse_attention.nodes.model_patches import AttentionDispatch, block_hooks
from adaptive_sparse_attention.nodes.comfy_weights import head_groups
from adaptive_sparse_attention.nodes.h3_model import LayoutCache, check_h3
from adaptive_sparse_attention.nodes.block_hook import CallContext, bind, bound_hook
from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook
from h3_block import PackedLayout, block_args, layout_of, malloc_graph_standin
from h3_harness import PACKED, TOL, config, model_of, options, reference, run_model, sparse_oracle


@pytest.mark.parametrize("new", [True, False], ids=["current", "pinned"])
def test_what_each_upstream_publishes_to_the_blocks(new):
    """Current upstream writes the layout and the block index into the caller's transformer_options;
    the hook finds the layout there alone, leaves both as H3 set them and leaves nothing of its own."""
    model = model_of(new, seed=21)
    args = block_args(model.blocks[0], PACKED, seed=22, new=False)  # no "layout" in the base args
    to = args["transformer_options"] = options()
    hook = SparseAttentionHook(config(topk_ratio=0.25))
    out = run_model(model, hook, args, new)
    torch.testing.assert_close(out, reference(model, args, sparse_oracle(config(topk_ratio=0.25))), **TOL)
    assert hook.tracker.stats.sparse_blocks == 2
    assert hook.key not in to
    assert (to.get("block_index"), to.get("minimax_h3_layout")) == ((1, PACKED) if new else (None, None))
    ctx = CallContext(hook, model)  # no payload layout: current upstream's options alone suffice
    assert (hook.layout({"transformer_options": to}, ctx) is not None) == new


@pytest.mark.parametrize("new", [True, False], ids=["args-attention", "attn-object-patch"])
def test_ratio_one_matches_the_dense_block(new):
    model = model_of(new)
    args = block_args(model.blocks[0], PACKED, seed=1, new=new)
    args["transformer_options"] = options()
    hook = SparseAttentionHook(config(topk_ratio=1.0))
    out = run_model(model, hook, args, new)
    dense = reference(model, args, lambda block: block.attn)
    torch.testing.assert_close(out, dense, **TOL)
    assert hook.tracker.stats.sparse_blocks == 2
    assert hook.tracker.stats.dense_blocks == 0


@pytest.mark.parametrize("new", [True, False], ids=["args-attention", "attn-object-patch"])
@pytest.mark.parametrize("kw", [dict(topk_ratio=0.25), dict(topk_ratio=0.5, tail="mean", tail_granularity="block"),
                                dict(topk_ratio=0.3, tail="none", block_size=128), dict(tiling="reblock")])
def test_sparse_block_matches_the_reference(new, kw):
    model = model_of(new, seed=2, layers=1)
    args = block_args(model.blocks[0], PACKED, seed=3, new=new)
    args["transformer_options"] = options()
    cfg = config(**kw)
    out = run_model(model, SparseAttentionHook(cfg), args, new)
    torch.testing.assert_close(out, reference(model, args, sparse_oracle(cfg)), **TOL)
    dense = reference(model, args, lambda block: block.attn)
    assert (out - dense).abs().max() > 1e-6  # the sparse path really ran


@pytest.mark.parametrize("new,tiling", [(True, "cube"), (False, "cube"), (True, "reblock")])
def test_head_subset_calls_and_list_input(new, tiling):
    """KJNodes' low-VRAM nodes split heads into groups and hand the input in a list."""
    model = model_of(new, seed=4, layers=1)
    args = block_args(model.blocks[0], PACKED, seed=5, new=new)
    cfg = config(topk_ratio=0.3, tiling=tiling)
    args["transformer_options"] = options(minimax_head_chunks=2)  # 3 heads -> groups of 2 and 1
    grouped = run_model(model, SparseAttentionHook(cfg), args, new)
    args["transformer_options"] = options()
    whole = run_model(model, SparseAttentionHook(cfg), args, new)
    torch.testing.assert_close(grouped, whole, **TOL)
    assert head_groups(3, 2) == [(0, 2), (2, 3)]
    assert head_groups(56, 4)[-1] == (42, 56)
    assert head_groups(4, "x") == [(0, 4)]

    block = model.blocks[0]
    hook = SparseAttentionHook(cfg)
    token = (0, layout_of(PACKED), hook.engine_config, (), (None, None))  # (step, layout, config, branch, sigmas)
    x = args["img"].clone()
    listed = hook.attend(0, token, block.attn, [x.clone()], args["rope_freqs"], {}, None)
    torch.testing.assert_close(listed, hook.attend(0, token, block.attn, x, args["rope_freqs"], {}, None), **TOL)


def test_warmup_steps_under_cfg_then_sparse():
    model = model_of(True, seed=6, layers=1)
    args = block_args(model.blocks[0], PACKED, seed=7, new=True)
    hook = SparseAttentionHook(config(warmup_mode="fidelity", warmup_ratio=0.3))  # ceil(0.3 * 5) = 2 steps
    for step in range(5):
        for cond in (0, 1):  # a CFG pair is two model calls of one step
            args["transformer_options"] = options(step, 5, cond_or_uncond=[cond])
            run_model(model, hook, args, True)
    s = hook.tracker.stats
    assert (s.dense_steps - s.sparse_steps, s.sparse_steps) == ({0, 1}, {2, 3, 4})
    assert (s.dense_blocks, s.sparse_blocks) == (2 * 2, 3 * 2)
    line = hook.tracker.finish()
    assert "steps 2 dense / 3 sparse" in line
    assert "blocks 4 dense / 6 sparse" in line
    assert hook.tracker.stats.sparse_blocks == 0
    assert not hook.tracker.densities  # reset after the run


def test_dense_layers_min_tokens_and_dense_mode(caplog):
    model = model_of(True, seed=8)
    args = block_args(model.blocks[0], PACKED, seed=9, new=True)
    overridden = []
    args["transformer_options"] = options(optimized_attention_override=lambda *a, **k: overridden.append(1))
    for cfg, sparse in ((config(dense_layers="1"), 1), (config(min_tokens=PACKED.seq_len + 1), 0),
                        (config(warmup_mode="dense"), 0)):
        hook = SparseAttentionHook(cfg)
        out = run_model(model, hook, args, True)
        assert hook.tracker.stats.sparse_blocks == sparse
        if sparse == 0:
            torch.testing.assert_close(out, reference(model, args, lambda block: block.attn), **TOL)
    # another node's attention override is not called by sparse blocks (so it cannot recurse) and it is said so
    assert not overridden and any("optimized_attention_override applies to dense blocks only" in r.getMessage()
                                  for r in caplog.records)


def test_strict_errors_and_logged_fallbacks(caplog, monkeypatch):
    model = model_of(True, seed=10, head_dim=48)  # head_dim 48 is not a kernel head size
    args = block_args(model.blocks[0], PACKED, seed=11, new=True)
    args["transformer_options"] = options()
    with pytest.raises(RuntimeError, match=r"runs dense: .*head_dim=48.*\(strict mode\)"):
        run_model(model, SparseAttentionHook(config(strict=True)), args, True)
    hook = SparseAttentionHook(config())
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        for step in range(3):
            args["transformer_options"] = options(step)
            out = run_model(model, hook, args, True)
    assert sum("head_dim=48" in r.getMessage() for r in caplog.records) == 2  # once per layer per run
    torch.testing.assert_close(out, reference(model, args, lambda block: block.attn), **TOL)

    model = model_of(True, seed=12)
    args = block_args(model.blocks[0], PACKED, seed=13, new=True)
    args["layout"] = PackedLayout(5, 4, 16, 12, 3)  # does not match the input rows
    args["transformer_options"] = options()
    with pytest.raises(RuntimeError, match="does not match the layout"):
        run_model(model, SparseAttentionHook(config(strict=True)), args, True)
    layout = layout_of(PACKED)
    attn, shape = model.blocks[0].attn, (layout.total, 32)
    assert "device meta" in sparse_call.call_problem(attn, shape, torch.float32, torch.device("meta"), layout)
    assert "int" in sparse_call.call_problem(attn, shape, torch.int32, torch.device("cpu"), layout)
    assert "layout was not found" in sparse_call.call_problem(attn, shape, torch.float32, torch.device("cpu"), None)
    assert "does not match" in sparse_call.call_problem(attn, (layout.total + 1, 32), torch.float32, torch.device("cpu"), layout)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU tensors: Triton cannot run, strict says so
    args["layout"] = PACKED
    with pytest.raises(RuntimeError, match="triton.*strict"):
        run_model(model, SparseAttentionHook(config(strict=True, kernel="triton")), args, True)


def test_chains_earlier_patches_and_object_patches():
    """A replacement registered before ours and another node's attn.forward patch keep working."""
    model = model_of(False, seed=14)
    args = block_args(model.blocks[0], PACKED, seed=15, new=False)
    calls = {"replace": 0, "forward": 0}

    def earlier(args, extra):
        calls["replace"] += 1
        return extra["original_block"](args)

    def other_forward_of(attn):
        plain = attn.forward

        def forward(x, rope_freqs=None, transformer_options={}):  # noqa: B006
            calls["forward"] += 1
            return plain(x, rope_freqs=rope_freqs, transformer_options=transformer_options)
        return forward

    others = {f"diffusion_model.blocks.{i}.attn.forward": other_forward_of(b.attn) for i, b in enumerate(model.blocks)}
    args["transformer_options"] = options(0)
    hook = SparseAttentionHook(config(warmup_mode="fidelity", dense_layers="1"))
    dense = run_model(model, hook, args, False, previous={0: earlier, 1: earlier}, object_patches=others)
    assert calls == {"replace": 2, "forward": 2}  # warmup step: both blocks dense through the other patch
    torch.testing.assert_close(dense, reference(model, args, lambda block: block.attn), **TOL)
    args["transformer_options"] = options(5)
    run_model(model, hook, args, False, previous={0: earlier, 1: earlier}, object_patches=others)
    assert calls == {"replace": 4, "forward": 3}  # block 0 sparse (ours), block 1 dense_layers (theirs)
    _, patches = block_hooks(model, hook, {}, others)
    assert all(isinstance(p, AttentionDispatch) and p.previous is others[k] for k, p in patches.items())


def test_the_nearest_hook_to_the_sampler_wins():
    """A second hook of the same kind replaces the first one's patches (it is not chained)."""
    model = model_of(True, seed=16)
    args = block_args(model.blocks[0], PACKED, seed=17, new=True)
    args["transformer_options"] = options()
    inner, outer = SparseAttentionHook(config(topk_ratio=0.25)), SparseAttentionHook(config(topk_ratio=1.0))
    first, _ = block_hooks(model, inner, {}, {})
    out = run_model(model, outer, args, True, previous=first)
    torch.testing.assert_close(out, reference(model, args, lambda block: block.attn), **TOL)
    assert inner.tracker.stats.sparse_blocks == 0
    assert outer.tracker.stats.sparse_blocks == 2


def test_clones_and_model_copies_run_with_their_own_state():
    """ComfyUI's clone() (attachments) and a deep copy of the model give the copy its own hook: same
    settings, own tracker, its reports also reaching the original's."""
    import copy

    model = model_of(True, seed=25)
    args = block_args(model.blocks[0], PACKED, seed=26, new=True)
    args["transformer_options"] = options()
    hook = SparseAttentionHook(config())
    run_model(model, hook, args, True)
    twin = hook.on_model_patcher_clone()
    assert twin.config is hook.config
    assert twin.tracker is not hook.tracker
    assert twin.tracker.parent is hook.tracker
    bind(model, hook)
    copied = copy.deepcopy(model)
    own = bound_hook(copied, hook.key)
    assert isinstance(own, SparseAttentionHook)
    assert own is not hook
    assert own.tracker.stats.sparse_blocks == 0
    with torch.no_grad():
        model.blocks[0].attn.qkv_proj.weight.zero_()  # the original changes; the copy computes with its own
    before = run_model(copied, own, args, True)
    assert own.tracker.stats.sparse_blocks == 2
    assert hook.tracker.stats.sparse_blocks == 2
    torch.testing.assert_close(before, reference(copied, args, sparse_oracle(config())), **TOL)
    own.tracker.finish()
    assert hook.tracker.last_report["blocks_sparse"] == 2  # the copy's report reaches the original's tracker


def test_layout_discovery_and_bounded_cache():
    model = model_of(True, seed=18)
    hook = SparseAttentionHook(config())
    ctx = CallContext(hook, model)
    assert hook.layout({"layout": PACKED}, ctx) == layout_of(PACKED)
    assert hook.layout({"transformer_options": {"minimax_h3_layout": PACKED}}, ctx) == layout_of(PACKED)
    assert hook.layout({}, CallContext(hook, model, packed=PACKED)) == layout_of(PACKED)
    assert hook.layout({}, ctx) is None
    cache = LayoutCache(size=2)
    for t in (4, 2, 3, 4):
        cache.of(PackedLayout(5, t, 16, 16, 3))
    assert len(cache.entries) == 2
    assert hook.layout({"layout": PACKED}, ctx) is hook.layout({"layout": PackedLayout(5, 4, 16, 16, 3)}, ctx)
    # the wrapper rebuilds a layout whose signature does not match the call (older upstream path)
    video, audio = torch.zeros(1, 24, 4, 16, 16), torch.zeros(1, 32, 2, 3)
    assert h3_model.payload_layout(model, [video, audio], torch.zeros(1, 5, 8), {"layout": PACKED}) is PACKED
    rebuilt = h3_model.payload_layout(model, [video[:, :, :2], audio[..., :2]], torch.zeros(1, 5, 8), {"layout": PACKED})
    assert rebuilt.signature == (5, 2, 16, 16, 2)
    assert layout_of(rebuilt).total == 5 + 4 + 128


def test_model_check():
    check_h3(model_of(True))

    class Flux(torch.nn.Module):
        pass
    with pytest.raises(ValueError, match="only patches ComfyUI's MiniMax-H3 model.*Flux"):
        check_h3(Flux())

    class Patcher:  # the part of a ModelPatcher the check reads
        model_options: dict = {}

        def __init__(self, diffusion_model):
            self.diffusion_model = diffusion_model

        def get_model_object(self, name):
            return getattr(self, name)
    assert h3_model.h3_diffusion_model(Patcher(model_of(True)), "Node").blocks
    for not_a_model in ("a string", torch.zeros(1), {"model": 1}):
        with pytest.raises(TypeError, match=r"Node\.model must be a ComfyUI MODEL \(a ModelPatcher"):
            h3_model.h3_diffusion_model(not_a_model, "Node")
    with pytest.raises(ValueError, match="only patches ComfyUI's MiniMax-H3 model.*Flux"):
        h3_model.h3_diffusion_model(Patcher(Flux()), "Node")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_producer_matches_the_block(dtype):
    """The producer (its default epilogue, the torch reference) gives the block's own q, k, v for any chunk
    size and head range (the Triton epilogue: test_norm_rope.py)."""
    block = model_of(True, seed=19).blocks[0].to(dtype)
    args = block_args(block, PACKED, seed=20, new=True, dtype=dtype)
    attn = block.attn
    expected = [t for t in attn.qkv(args["img"], args["rope_freqs"])]
    tol = TOL if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    for chunk, heads in ((7, None), (4096, (1, 3)), (100, (0, 1))):
        got = producer.produce_qkv(args["img"], attn.qkv_proj.weight, None, 3, 32, attn.q_norm.weight,
                                   attn.k_norm.weight, attn.q_norm.eps, args["rope_freqs"], heads, chunk)
        h0, h1 = heads or (0, 3)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e[:, h0:h1], **tol)
    with pytest.raises(ValueError, match="heads"):
        producer.produce_qkv(args["img"], attn.qkv_proj.weight, None, 3, 32, attn.q_norm.weight,
                             attn.k_norm.weight, 1e-5, None, (2, 2))


def test_kernels_are_prepared_in_the_first_warmup_call(monkeypatch):
    """The first block call of a layout compiles the sparse kernels, before any sparse step."""
    prepared = []
    monkeypatch.setattr(preparation, "prepare", lambda *a, announce: prepared.append(a))
    model = model_of(True, seed=12)
    args = block_args(model.blocks[0], PACKED, seed=13, new=True)
    args["transformer_options"] = options(step=0)
    hook = SparseAttentionHook(config(warmup_mode="fidelity", dense_layers="1"))
    run_model(model, hook, args, True)
    assert hook.tracker.stats.sparse_blocks == 0  # a warmup step
    (layout, cfg, dtype, device, head_dim, heads), = prepared  # layer 0 only: layer 1 is always dense
    assert layout == layout_of(PACKED)
    assert cfg is hook.engine_config
    assert (head_dim, heads) == (model.blocks[0].attn.head_dim, model.blocks[0].attn.heads)
    assert cfg.precision == "bf16"  # resolved: the engine never sees "auto"


def test_kernels_are_prepared_at_the_head_count_of_one_call_under_head_groups(monkeypatch):
    """With KJNodes' head groups a sparse call holds one group's heads: the preparation runs at the largest
    group's count (its buffers grow with the heads, and head groups are there to keep memory down)."""
    prepared = []
    monkeypatch.setattr(preparation, "prepare", lambda *a, announce: prepared.append(a))
    model = model_of(True, seed=12)
    args = block_args(model.blocks[0], PACKED, seed=13, new=True)
    args["transformer_options"] = dict(options(step=0), minimax_head_chunks=2)
    hook = SparseAttentionHook(config(warmup_mode="fidelity", dense_layers="1"))
    run_model(model, hook, args, True)
    heads = model.blocks[0].attn.heads
    assert [a[-1] for a in prepared] == [-(-heads // 2)]


def test_sparse_path_and_kernel_preparation_run_outside_comfyuis_allocation_graph(monkeypatch):
    """Current upstream records the allocations of an H3 forward on CUDA and pauses that with
    comfy.model_prefetch.pause_malloc_graph() (the pinned fork has neither): the engine's tensors
    that outlive a call must not come from that record."""
    depth = malloc_graph_standin(monkeypatch)
    seen = []
    attention = sparse_call.sparse_attention
    monkeypatch.setattr(sparse_call, "sparse_attention", lambda *a, **k: seen.append(("sparse", len(depth))) or attention(*a, **k))
    monkeypatch.setattr(preparation, "prepare", lambda *a, announce: seen.append(("prepare", len(depth))))
    model = model_of(True, seed=23, layers=1)
    args = block_args(model.blocks[0], PACKED, seed=24, new=True)
    hook = SparseAttentionHook(config(warmup_mode="fidelity", warmup_ratio=0.3))
    for step in (0, 5):  # a warmup step (kernels prepared), then a sparse one
        args["transformer_options"] = options(step)
        run_model(model, hook, args, True)
    assert {kind for kind, _ in seen} == {"sparse", "prepare"}
    assert all(d == 1 for _, d in seen)
    assert not depth


def test_core_sparse_patches_are_found_by_their_module_or_their_mark():
    """Older core nodes are known by the module of their block patches, newer ones also by the
    `_block_sparse_attention_patch` attribute they set on them."""
    def ours(args, extra):
        return extra["original_block"](args)

    def marked(args, extra):
        return extra["original_block"](args)

    marked._block_sparse_attention_patch = object()
    dit = {("double_block", 0): ours, ("double_block", 1): marked}
    options = {"transformer_options": {"patches_replace": {"dit": dit}}}
    assert core_sparse.core_sparse_blocks(options) == [1]
    with pytest.raises(ValueError, match="Model Sparse Attention.*applied after this node.*Keep one"):
        core_sparse.refuse_core_sparse(options, "t", "after")
