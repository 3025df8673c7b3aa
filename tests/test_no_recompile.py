"""A new clip length or head count compiles no new kernel: Triton's own launch specialisations.

Triton compiles one binary per specialisation of a kernel's arguments: the constexpr values,
and for plain integers and pointers whether they equal 1 or are multiples of 16. Every launch
of a whole `sparse_attention` call (the fused planner kernels included) is recorded in the
interpreter, and each launch's specialisation is computed by Triton's own binder for an sm90
target. Two calls whose clip lengths (text, audio, frames) and head counts differ must launch
the same set of specialisations.

By design, kernels that hold a whole row in registers (radix-select rows, reblock levels)
specialise on a bucket of that row's width (radix-select rows: three per power of two,
`radix_select.row_split`; reblock levels: a power of two); `ROW_BUCKETS` names those
constexprs, and a third length in another bucket may differ in them only. The per-head tiling
choice (`head_choice`) runs on the torch path in the pipeline test, because its top-share kernel
takes over a minute in the interpreter; its two kernels are checked launcher by launcher.
"""
from __future__ import annotations


import pytest
import torch

from triton_interpreter import kernel_imports

with kernel_imports():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from adaptive_sparse_attention.kernels.triton.block_mass import block_log_mass_triton, top_share_triton

from adaptive_sparse_attention import SequenceLayout, SparseConfig, sparse_attention

pytestmark = pytest.mark.usefixtures("interpreter")

TARGET = GPUTarget("cuda", 90, 32)
ROW_BUCKETS = {"_select_group": {"HEAD", "TAIL"}, "_top_share": {"HEAD", "TAIL"},
               "_split_directions": {"MP", "CH"}, "_split_level": {"BLOCK", "WIDE"}}
Launch = tuple  # (kernel name, ((argument, specialisation), ...), options)


def record_launches(monkeypatch: pytest.MonkeyPatch, execute: bool) -> list[Launch]:
    """Every interpreted launch from now on, with the specialisation Triton would compile for it;
    without `execute` the kernels do not run (for launchers whose outputs are not read)."""
    backend, binders, seen = CUDABackend(TARGET), {}, []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if self.fn not in binders:
            jit = JITFunction(self.fn, **self.kwargs)
            binders[self.fn] = (jit.arg_names, create_function_from_signature(jit.signature, jit.params, backend))
        names, binder = binders[self.fn]
        _, spec, options = binder(*args, **kwargs)
        seen.append((self.fn.__name__, tuple(zip(names, map(tuple, spec))), tuple(sorted(options.items()))))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs) if execute else None

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    return seen


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    return record_launches(monkeypatch, execute=True)


def clip(text: int, audio: int, frames: int, h: int, w: int) -> SequenceLayout:
    video = frames * h * w
    return SequenceLayout.from_segments([(0, text, "text"), (text, text + audio, "audio"),
                                         (text + audio, text + audio + video, "video", (frames, h, w))])


def specialisations(launches: list[Launch], layout: SequenceLayout, heads: int, config: SparseConfig
                    ) -> set[Launch]:
    launches.clear()
    g = torch.Generator().manual_seed(layout.total)
    q, k, v = (torch.randn(1, heads, layout.total, 32, generator=g) for _ in range(3))
    sparse_attention(q, k, v, layout, config)
    return set(launches)


def without_buckets(launch: Launch) -> Launch:
    name, spec, options = launch
    bucketed = ROW_BUCKETS.get(name, set())
    return name, tuple(a for a in spec if a[0] not in bucketed), tuple(o for o in options if o[0] != "num_warps")


CONFIGS = {
    "reblock-reweight-query": SparseConfig(topk_ratio=0.2, kernel="triton", min_tokens=0),
    "cube-mean-block": SparseConfig(topk_ratio=0.2, kernel="triton", min_tokens=0, tiling="cube", tail="mean",
                                    tail_granularity="block"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_new_clip_length_and_head_count_launch_the_same_binaries(name, launches, monkeypatch):
    from adaptive_sparse_attention.backend import head_choice, reblock

    # the per-head tube choice on torch: its kernels have their own test below, and interpreted they
    # would take minutes here
    monkeypatch.setattr(reblock, "choose_tubes", lambda *args: head_choice.choose_tubes(*args[:-1]))
    config = CONFIGS[name]
    first = specialisations(launches, clip(37, 53, 3, 5, 6), 2, config)
    second = specialisations(launches, clip(29, 71, 3, 6, 6), 3, config)  # same row buckets
    assert {launch[0] for launch in first} >= {"_block_sparse_fwd", "_pooled_scores", "_select_group"}
    assert first == second, sorted(first ^ second)
    if config.tiling != "reblock":
        return
    other = specialisations(launches, clip(41, 60, 5, 6, 7), 2, config)  # longer rows: other buckets
    assert {without_buckets(x) for x in other} == {without_buckets(x) for x in first}
    for launch in other - first:
        for arg, (kind, value) in launch[1]:
            if arg in ROW_BUCKETS.get(launch[0], ()) and kind == "constexpr" and not isinstance(value, bool):
                assert value & (value - 1) == 0, (launch[0], arg, value)


def test_head_choice_kernels_do_not_specialise_on_length(monkeypatch):
    seen = record_launches(monkeypatch, execute=False)

    def calls(n_blocks: int, tokens: int) -> list[Launch]:
        seen.clear()
        g = torch.Generator().manual_seed(n_blocks)
        perm = torch.randperm(tokens, generator=g).to(torch.int32)
        perm = torch.cat([perm, perm.new_full((n_blocks * 16 - tokens,), -1)]).view(1, -1)
        block_log_mass_triton(torch.randn(3, 16, 32, generator=g), torch.randn(3, tokens, 32, generator=g), perm, 16)
        top_share_triton(torch.randn(3, 16, n_blocks, generator=g), max(1, n_blocks // 5))
        return list(seen)

    first = calls(37, 580)
    assert [launch[0] for launch in first] == ["_block_log_mass", "_top_share"]
    assert first == calls(48, 700)  # 37 and 48 key blocks: one row bucket, 48 a multiple of 16


def test_the_producer_epilogue_launches_one_binary(monkeypatch):
    """The QKV producer's epilogue launches one specialisation for every chunk of any clip length, any head
    group, and for the preparation's call (`prepare.epilogue`), which must compile it for the run."""
    from adaptive_sparse_attention.backend.producer import CHUNK_ROWS, produce_qkv
    from adaptive_sparse_attention.backend.prepare import epilogue
    from adaptive_sparse_attention.kernels.registry import resolve

    seen = record_launches(monkeypatch, execute=False)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    kernels = resolve("triton", cpu, bf16, head_dim=32, strict=True)
    g = torch.Generator().manual_seed(0)
    epilogue(kernels, 3, 32, bf16, cpu, g)
    scale = torch.ones(32, dtype=bf16)
    for rows, heads in ((CHUNK_ROWS + 37, (0, 3)), (2 * CHUNK_ROWS + 5, (1, 3)), (100, (0, 1))):
        x = torch.randn(rows, 48, generator=g).to(bf16)
        weight = torch.randn(3 * 3 * 32, 48, generator=g).to(bf16)
        table = torch.randn(1, rows, 1, 12, 2, 2, generator=g).to(bf16)  # H3's rot_dim is 3/4 of the head
        produce_qkv(x, weight, None, 3, 32, scale, scale, 1e-6, table, heads, norm_rope=kernels.norm_rope)
    assert len(seen) == 1 + 2 + 3 + 1
    assert len(set(seen)) == 1, sorted(set(seen))
