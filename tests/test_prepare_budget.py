"""`prepare` on every card: each shape is sized before it runs (`bench.prepare.shape_bytes`) against the memory
the process can still take; a shape that does not fit, or runs out of memory all the same, is skipped and
named, and the rest go on (CPU: the torch reference compiles nothing, the dense choice on the CPU is SDPA's)."""
from __future__ import annotations

import pytest
import torch

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.bench import prepare as bench_prepare
from adaptive_sparse_attention.bench.prepare import Rung, prepare, rungs, shape_bytes
from adaptive_sparse_attention.bench.scenes import SceneSize
from adaptive_sparse_attention.kernels.dense.choice import DenseChoices

CPU = torch.device("cpu")


def test_a_shape_is_sized_from_its_tokens_heads_and_dtype():
    """1,000 tokens, 56 heads of 128, bf16: one [1, H, S, D] tensor is 14,336,000 bytes; the sparse step holds
    Q/K/V, two outputs with their fp32 rows (224,000 bytes each), three 8-head copies (2,048,000 each), the
    planner's 20% of Q/K/V and three float32 tensors of two heads (1,024,000 each): 89,945,600 bytes, more
    than the dense step's 74,752,000. Twice the tokens, twice the bytes; float32 twice bf16 but the fp32 rows."""
    size = SceneSize(0, 0, (1, 10, 100), 56, 128)
    assert size.total == 1000
    assert shape_bytes(size, torch.bfloat16) == 89_945_600
    assert shape_bytes(SceneSize(0, 0, (2, 10, 100), 56, 128), torch.bfloat16) == 2 * 89_945_600
    assert shape_bytes(size, torch.float32) == 2 * 89_945_600 - 2 * 224_000 - 3 * 1_024_000


def test_prepares_sizes_grow_with_the_clip_up_to_the_60_s_shape():
    """The last of `prepare`'s shapes (398,783 tokens) needs about 31 GiB: more than a 24 GiB card has, so
    there it is skipped, not allowed to stop the rest."""
    sizes = [shape_bytes(r.size, torch.bfloat16) for r in rungs(60.0)]
    assert max(sizes) == sizes[-1]
    assert 30 * 2 ** 30 < sizes[-1] < 35 * 2 ** 30


def small_rungs() -> list[Rung]:
    return [Rung(f"{frames} frames", SceneSize(8, 8, (frames, 4, 4), 2, 32)) for frames in (1, 4, 2, 8)]


def test_a_shape_that_does_not_fit_the_budget_is_skipped_and_named(tmp_path):
    """A budget between the second-smallest and the next shape: the two that fit run (in their order), the two
    that do not are skipped, each named on its own line with what it needs, and once more in the summary."""
    shapes = small_rungs()
    budget = shape_bytes(shapes[2].size, torch.float32)  # the 2-frame shape fits exactly
    said: list[str] = []
    result = prepare(shapes, CPU, torch.float32, SparseConfig(kernel="torch"), DenseChoices(tmp_path / "d.json"),
                     echo=said.append, budget=lambda: budget)
    assert list(result) == ["1 frames", "2 frames"]
    skipped = [line for line in said if "skipped, it needs about" in line]
    assert [line.split(" (")[0] for line in skipped] == ["prepare 4 frames", "prepare 8 frames"]
    assert said[-1] == "prepare: 2 of 4 shapes prepared; skipped for lack of GPU memory: 4 frames, 8 frames"


def test_a_shape_out_of_memory_is_skipped_and_the_rest_go_on(tmp_path, monkeypatch):
    """A shape that runs out of memory while its kernels are prepared is named and skipped; the shapes after it
    still run; with room for all, nothing else is skipped."""
    real = bench_prepare.prepare_kernels

    def short_of_memory(layout, *args, **kwargs):
        if layout.total == small_rungs()[1].size.total:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(layout, *args, **kwargs)

    monkeypatch.setattr(bench_prepare, "prepare_kernels", short_of_memory)
    said: list[str] = []
    result = prepare(small_rungs(), CPU, torch.float32, SparseConfig(kernel="torch"), DenseChoices(tmp_path / "d.json"),
                     echo=said.append, budget=lambda: 1 << 40)
    assert list(result) == ["1 frames", "2 frames", "8 frames"]
    assert any(line.startswith("prepare 4 frames") and "ran out of memory (OutOfMemoryError: CUDA out of memory"
               in line for line in said)
    assert said[-1] == "prepare: 3 of 4 shapes prepared; skipped for lack of GPU memory: 4 frames"


def test_everything_fits_a_large_budget_and_no_summary_is_said(tmp_path):
    said: list[str] = []
    result = prepare(small_rungs(), CPU, torch.float32, SparseConfig(kernel="torch"), DenseChoices(tmp_path / "d.json"),
                     echo=said.append, budget=lambda: 1 << 40)
    assert len(result) == 4 and not any("skipped" in line for line in said)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads the CUDA allocator")
def test_the_free_memory_honours_the_allocators_cap():
    """With the allocator capped (how `e2e --vram-gib` emulates a smaller card) the free memory is the cap's."""
    device = torch.device("cuda", torch.cuda.current_device())  # the fraction's functions need an index
    before = torch.cuda.get_per_process_memory_fraction(device)
    total = torch.cuda.mem_get_info(device)[1]
    try:
        torch.cuda.set_per_process_memory_fraction(0.25, device)
        assert bench_prepare.free_bytes(device) <= 0.25 * total
        assert bench_prepare.free_bytes(torch.device("cuda")) <= 0.25 * total  # as `prepare` passes it
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


def test_the_packed_heads_are_the_kernels():
    """`shape_bytes` counts the 8-head copies the Triton and cuDNN kernels pack at a time."""
    pytest.importorskip("triton")
    from adaptive_sparse_attention.kernels.cudnn.cudnn_attention import HEADS_PER_CALL as cudnn_heads
    from adaptive_sparse_attention.kernels.triton.attention import HEADS_PER_CALL as triton_heads

    assert bench_prepare.PACKED_HEADS == triton_heads == cudnn_heads
