"""Kernel preparation has one owner (`backend/prepare.py`): one synchronous call per layout in this process,
counting what Triton loads and compiles; the node starts no process during a run, and the layouts (with what
was built and prepared for them) are shared by every patch and clone of one loaded model."""
from __future__ import annotations

import copy
import importlib.util
import logging
import math
import subprocess

import pytest
import torch

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.backend import prepare as prep
from adaptive_sparse_attention.nodes import preparation
from adaptive_sparse_attention.nodes.model_state import model_state
from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook
from h3_block import block_args, layout_of
from h3_harness import PACKED, config, model_of, options, run_model

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (interpreter)")


def no_process(*args, **kwargs):
    raise AssertionError(f"a process was started during a run: {args[:1]}")


@needs_triton
def test_a_run_starts_no_process_and_prepares_once_per_layout(monkeypatch, interpreter, caplog):
    """Warmup steps and sparse steps of the Triton family (the interpreter stands in for a GPU): no
    `subprocess.Popen` anywhere in the run; the layout is prepared once, at its first block call, in this
    process, and the console says what compiled and what loaded with its seconds."""
    monkeypatch.setattr(subprocess, "Popen", no_process)
    launched = []
    launch_all = prep.launch_all
    monkeypatch.setattr(prep, "launch_all", lambda *a, **k: launched.append(a[0].total) or launch_all(*a, **k))
    model = model_of(True, seed=12, layers=1).to(torch.float32)
    args = block_args(model.blocks[0], PACKED, seed=13, new=True, dtype=torch.float32)
    hook = SparseAttentionHook(config(kernel="triton", warmup_mode="fidelity", warmup_ratio=0.3))
    with caplog.at_level(logging.INFO, logger="adaptive_sparse_attention"):
        for step in (0, 1, 5, 6):  # two warmup steps, then two sparse ones
            args["transformer_options"] = options(step)
            run_model(model, hook, args, True)
    assert hook.tracker.stats.sparse_blocks == 2
    assert launched == [layout_of(PACKED).total]
    ready = [r.getMessage() for r in caplog.records if "kernels ready in" in r.getMessage()]
    assert len(ready) == 1 and "compiled" in ready[0] and "loaded from Triton's cache" in ready[0]


def test_builds_are_counted_through_the_compilation_listener():
    """What Triton's listener reports while a preparation runs: disk-cache hits and compiles, the first
    compile said once; the listener Triton had before is put back."""
    said = []
    triton = pytest.importorskip("triton")
    before = triton.knobs.compilation.listener
    with prep.counting_builds(lambda: said.append("compiling")) as builds:
        listener = triton.knobs.compilation.listener
        listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=True)
        listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=False)
        listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=False)
    assert (builds.loaded, builds.compiled, said) == (1, 2, ["compiling"])
    assert triton.knobs.compilation.listener is before


def test_nothing_is_prepared_for_the_torch_reference():
    """The torch reference compiles nothing: no preparation, no record."""
    layout = layout_of(PACKED)
    assert prep.prepare(layout, SparseConfig(kernel="torch"), torch.float32, torch.device("cpu"), 32, 2) is None
    assert not layout.cache.has("prepared", prep.preparation_key(SparseConfig(kernel="torch"), torch.float32,
                                                                 torch.device("cpu"), 32, 2))


def test_patches_and_clones_of_one_model_share_its_layouts(monkeypatch):
    """Two hooks (a model patched again with other widgets) and a clone run on one diffusion model: one
    layout object per shape, so the statics and the preparation are built once; a deep copy of the model (a
    clone on another device) starts with its own layouts and shares the measured choices."""
    prepared = []
    monkeypatch.setattr(preparation, "prepare", lambda layout, *a, announce: prepared.append(layout))
    model = model_of(True, seed=12, layers=1)
    args = block_args(model.blocks[0], PACKED, seed=13, new=True)
    args["transformer_options"] = options(step=5)
    first = SparseAttentionHook(config(topk_ratio=0.25))
    again = SparseAttentionHook(config(topk_ratio=0.5))
    for hook in (first, again, first.on_model_patcher_clone()):
        run_model(model, hook, args, True)
    assert len(prepared) == 3 and prepared[0] is prepared[1] is prepared[2]
    assert len(model_state(model).layouts) == 1
    twin = copy.deepcopy(model)
    assert len(model_state(twin).layouts) == 0
    assert model_state(twin).dense_choices is model_state(model).dense_choices


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a CUDA GPU")
def test_after_the_fixed_set_no_clip_length_compiles(tmp_path, monkeypatch):
    """`install.py prepare`'s fixed set (`bench.prepare.rungs`, here up to 12 s) covers every clip length and
    canvas within it: preparing other lengths at the default settings, at H3's 56 heads and at fewer (a head
    group's), compiles nothing, and the Triton cache's file count does not change."""
    triton = pytest.importorskip("triton")
    from adaptive_sparse_attention.bench.prepare import CANVASES, clip_size, latent_frames, rungs

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    config, device, dtype = SparseConfig(), torch.device("cuda"), torch.bfloat16
    for rung in rungs(12.0):
        prep.prepare(rung.size.layout(), config, dtype, device, rung.size.head_dim, rung.size.heads)
    files = sum(1 for p in tmp_path.rglob("*") if p.is_file())
    for canvas, seconds, heads in (("0.4mp", 3.0, 56), ("0.9mp", 7.0, 56), ("1344x768", 4.0, 56),
                                   ("1344x768", 11.0, 56), ("1344x768", 7.0, 28), ("0.9mp", 4.0, 1)):
        size = clip_size(*CANVASES[canvas], latent_frames(seconds))  # fewer heads: KJNodes' head groups, Ulysses
        with prep.counting_builds() as builds:
            assert prep.prepare(size.layout(), config, dtype, device, size.head_dim, heads) is not None
        assert builds.compiled == 0, (canvas, seconds, heads, builds)
    assert sum(1 for p in tmp_path.rglob("*") if p.is_file()) == files


def test_the_packs_errors_share_one_type():
    """Bad input raises `SparseAttentionError`, a ValueError a caller can catch as the pack's own."""
    from adaptive_sparse_attention import SparseAttentionError, SequenceLayout, sparse_attention

    assert issubclass(SparseAttentionError, ValueError)
    with pytest.raises(SparseAttentionError, match="topk_ratio"):
        SparseConfig(topk_ratio=5.0)
    with pytest.raises(SparseAttentionError, match="does not match the layout"):
        q = torch.zeros(1, 1, 10, 32)
        sparse_attention(q, q, q, SequenceLayout.from_segments([(0, 12, "video", (1, 3, 4))]))


@needs_triton
def test_the_fixed_set_meets_every_row_bucket_up_to_its_length():
    """`prepare`'s shapes (`bench.prepare.rungs`) hold every row bucket of the clips a user makes, the clips computed
    here from H3's token counts (REFERENCE.md), not from the rungs' own helpers: every 17n + 5 frames up to 60 s
    at 1344x768 (42 x 24 = 1,008 video rows a latent frame, (N - 5) / 17 * 5 + 2 latent frames) and the template
    canvases (864x480: 27 x 15, 1280x736: 40 x 23 rows a latent frame) up to 10 s; a bucket is the radix select's
    row split and the power of two of the video key blocks (64 rows each), what a sparse call compiles for."""
    from adaptive_sparse_attention.bench.prepare import rungs
    from adaptive_sparse_attention.kernels.triton.radix_select import row_split

    def bucket_of(video_rows: int) -> tuple:
        blocks = -(-video_rows // 64)
        return row_split(blocks), 1 << (blocks - 1).bit_length()

    def latents(frames: int) -> int:
        return (frames - 5) // 17 * 5 + 2

    def sparse(latent: int, rows: int) -> bool:  # may run sparse at the default min_tokens (audio: < 12 a latent)
        return 256 + 12 * latent + latent * rows >= SparseConfig().min_tokens

    frames = range(5, 60 * 24 + 17, 17)  # 17n + 5, through the first count at or past 60 s
    clips = [(latents(n), 1008) for n in frames]
    clips += [(latents(n), rows) for n in frames if n <= 10 * 24 + 17 for rows in (27 * 15, 40 * 23)]
    met = {bucket_of(math.prod(r.size.grid)) for r in rungs(60.0)}
    wanted = {bucket_of(t * rows) for t, rows in clips if sparse(t, rows)}
    assert len(wanted) > 10 and wanted <= met, sorted(wanted - met)
    # the rungs' video grids are H3's: 124 frames at 1344x768 are 37 latent frames, 37,296 video rows
    five = next(r.size for r in rungs(60.0) if r.name == "1344x768 5s")
    assert (five.grid, math.prod(five.grid), latents(124)) == ((37, 24, 42), 37_296, 37)
    assert len(rungs(60.0)) == len({r.name for r in rungs(60.0)}) < 40  # a small, fixed set
