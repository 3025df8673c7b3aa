"""Prepare a machine ahead of the first run: compile the fixed set of kernels, measure the dense and sparse choices.

What a sparse call compiles depends on the GPU, dtype, head size and count, config and the bucket of its
rows (`kernels/triton/radix_select.row_split`: three per power of two of a region's key blocks; the
reblock levels: the power of two), never on the exact clip length or resolution. `rungs` lists one H3
shape per bucket from the smallest clip to `--max-seconds` (60 s by default) at 1344x768, beside the
official templates' sizes (0.4 MP, 0.9 MP, 1344x768) at 2, 5 and 10 s; for each, this compiles (or loads)
the kernels (`backend.prepare.prepare`), measures the dense-kernel choice and the sparse-kernel choice
(bf16 and 8-bit bounds; the sparse one at every ratio class, once per row bucket), so a run compiles and
measures nothing it covers. The results persist (Triton's disk cache, the choice files). It also measures
from which clip length sparse attention pays on this GPU (bench/pays_from.py), which the node names when a
run is too small for it. Each shape is sized before it
runs (`shape_bytes`) against the memory this process can still take (`free_bytes`, which honours an allocator
cap): a shape that does not fit, or runs out of memory all the same, is skipped and named, and the rest go on.
`python install.py prepare` runs it (ComfyUI-Manager's install step does too, when it finds a GPU).
"""
from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..backend.attention import sparse_attention
from ..backend.config import SparseConfig
from ..backend.prepare import prepare as prepare_kernels
from ..kernels.dense.choice import CHECK_ROWS, DenseChoices, default_cache_path
from ..kernels.dense.choice import describe as describe_error
from ..kernels.sparse_choice.choice import RATIO_CLASSES, SparseChoices, rows_bucket
from ..kernels.sparse_choice.choice import default_cache_path as sparse_cache_path
from .scenes import SceneSize, strided_qkv

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# the official templates' canvases (ResolutionSelector 16:9, multiple 32) and the benchmark's 1344x768
CANVASES = {"0.4mp": (864, 480), "0.9mp": (1280, 736), "1344x768": (1344, 768)}
TEMPLATE_SECONDS = (2.0, 5.0, 10.0)
TEXT_TOKENS = 256
HEADS, HEAD_DIM = 56, 128  # H3's
GIB = 1 << 30
MARGIN_BYTES = GIB  # left free beside a shape: the CUDA context's growth, cuBLAS/cuDNN workspaces, fragmentation
PACKED_HEADS = 8  # heads a sparse kernel packs or quantises at a time (the Triton and cuDNN kernels' HEADS_PER_CALL)
PLANNER_SHARE = 0.2  # the planner's peak beside Q/K/V, a share of it (BENCHMARKS.md: at most 19% at a first plan)


@dataclass(frozen=True)
class Rung:
    """One shape `prepare` runs: its name and scene size."""

    name: str
    size: SceneSize


def latent_frames(seconds: float) -> int:
    """H3's latent frames of a clip of `seconds` as the templates make it: max(5, round(24 s)) frames
    snapped up to 17n + 5, then (frames - 5) / 17 * 5 + 2."""
    frames = max(5, round(seconds * 24))
    frames += (5 - frames % 17) % 17
    return (frames - 5) // 17 * 5 + 2


def clip_size(width: int, height: int, latents: int) -> SceneSize:
    """The tokens of an H3 clip: text, audio (about 11.25 tokens a latent frame) and the video grid
    (16x spatial VAE, 2x2 patches)."""
    return SceneSize(TEXT_TOKENS, round(11.25 * latents), (latents, height // 32, width // 32), HEADS, HEAD_DIM)


def bucket(size: SceneSize, block_size: int = 64) -> tuple:
    """What the row-width specialisations of a sparse call depend on: the radix-select split and the
    power of two of the video region's key blocks."""
    from ..kernels.triton.radix_select import row_split

    blocks = math.ceil(size.grid[0] * size.grid[1] * size.grid[2] / block_size)
    return row_split(blocks), 1 << max(0, math.ceil(math.log2(blocks)))


def rungs(max_seconds: float = 60.0) -> list[Rung]:
    """The templates' sizes at 2, 5 and 10 s, then one 1344x768 clip for each row bucket not met yet, up to
    `max_seconds`: together they compile every kernel a clip up to that length launches."""
    found = [Rung(f"{canvas} {s:g}s", clip_size(*CANVASES[canvas], latent_frames(s)))
             for canvas in CANVASES for s in TEMPLATE_SECONDS if s <= max_seconds]
    seen = {bucket(r.size) for r in found}
    for latents in range(2, latent_frames(max_seconds) + 1):
        size = clip_size(*CANVASES["1344x768"], latents)
        if bucket(size) not in seen:
            seen.add(bucket(size))
            found.append(Rung(f"1344x768 {latents} latent frames", size))
    return found


def comfy_user_dir(pack_dir: Path) -> Path | None:
    """ComfyUI's default user directory when the pack sits in ``ComfyUI/custom_nodes/<folder>``."""
    if pack_dir.parent.name == "custom_nodes" and (pack_dir.parent.parent / "main.py").is_file():
        return pack_dir.parent.parent / "user"
    return None


def shape_bytes(size: SceneSize, dtype: torch.dtype) -> int:
    """The most memory one shape of `prepare` holds at once, in bytes, from its sizes alone.

    The sparse step holds Q/K/V [1, H, S, D] (random, contiguous), its output and one candidate's output with
    their fp32 log-sum-exp rows, the 8-head copies a kernel packs or quantises at a time (PACKED_HEADS),
    the planner's buffers (PLANNER_SHARE of Q/K/V) and the float32 copies of the two heads the choice checks.
    The dense step holds the strided Q/K/V, room for a candidate's contiguous K/V copy and its float32
    reference (two heads of K/V and their CHECK_ROWS x S weights). The kernels step (one head expanded over
    the heads) holds less than either. The larger of the two steps is returned.

    Args:
        size: the shape.
        dtype: the model's compute dtype.
    Returns:
        Bytes.
    """
    element = torch.empty((), dtype=dtype).element_size()
    one = size.heads * size.total * size.head_dim * element  # one [1, H, S, D] tensor
    lse = size.heads * size.total * 4
    two_heads = 2 * size.total * size.head_dim * 4  # one float32 tensor of the two checked heads
    chunk = one * min(1.0, PACKED_HEADS / size.heads)
    sparse = 3 * one + 2 * (one + lse) + 3 * chunk + PLANNER_SHARE * 3 * one + 3 * two_heads
    dense = 3 * one + 2 * one + 2 * two_heads + 2 * CHECK_ROWS * size.total * 4
    return int(max(sparse, dense))


def free_bytes(device: torch.device) -> int:
    """What this process can still allocate on CUDA `device`: the driver's free memory, within the allocator's
    per-process cap where one is set (`torch.cuda.set_per_process_memory_fraction`, how a smaller card is
    emulated on a larger one), plus what torch's allocator holds unused."""
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    unused = reserved - torch.cuda.memory_allocated(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)  # needs an index
    return min(free, int(fraction * total) - reserved) + unused


def prepare(shapes: list[Rung], device: torch.device, dtype: torch.dtype, config: SparseConfig,
            choices: DenseChoices, echo=print, sparse_choices: SparseChoices | None = None,
            budget: Callable[[], int] | None = None) -> dict[str, dict[str, float]]:
    """Compile the kernels of `config` and measure the dense choice (and the sparse one) for each shape that fits.

    Before a shape runs its memory (`shape_bytes`) is compared with `budget()`: one that does not fit is
    skipped and named, and the next one is tried; one that runs out of memory all the same is freed, named
    and skipped too. A summary line names every shape skipped. The sparse choice is measured at the first
    shape of each of its row buckets (`sparse_choice.choice.rows_bucket`), for every ratio class.

    Args:
        shapes: `rungs()`.
        device: a CUDA device (the CPU runs the torch reference: nothing compiles, the dense choice is SDPA's).
        dtype: the model's compute dtype.
        config: the sparse configuration whose kernels are compiled (the node's defaults).
        choices: where the dense choices are measured and saved.
        echo: prints one line per step.
        sparse_choices: where the sparse choice of `config` is measured and saved (None: not measured).
        budget: the bytes a shape may take now; None: `free_bytes(device)` less MARGIN_BYTES.
    Returns:
        shape name -> {"kernels_s", "dense_s"} (and "sparse_s" where the sparse choice was measured), for the
        shapes that ran.
    """
    budget = budget or (lambda: free_bytes(device) - MARGIN_BYTES)
    result, skipped, measured = {}, [], set()
    for rung in shapes:
        need, room = shape_bytes(rung.size, dtype), budget()
        if need > room:
            skipped.append(rung.name)
            echo(f"prepare {rung.name} ({rung.size.total:,} tokens): skipped, it needs about {need / GIB:.1f} GiB "
                 f"and {max(0, room) / GIB:.1f} GiB is free on this GPU; a run of this size compiles and measures "
                 "it at its first sparse step")
            continue
        failed = None
        bucket = rows_bucket(rung.size.total)
        sparse = sparse_choices if bucket not in measured else None  # the sparse choice's key ignores the rest
        try:
            result[rung.name] = prepare_shape(rung, device, dtype, config, choices, echo, sparse)
            measured.add(bucket)
        except torch.OutOfMemoryError as err:
            failed = describe_error(err)
        if failed is not None:
            free_cache(device)
            skipped.append(rung.name)
            echo(f"prepare {rung.name} ({rung.size.total:,} tokens): skipped, it ran out of memory ({failed}); a run "
                 "of this size compiles and measures it at its first sparse step")
        free_cache(device)
    if skipped:
        echo(f"prepare: {len(result)} of {len(shapes)} shapes prepared; skipped for lack of GPU memory: "
             + ", ".join(skipped))
    return result


def free_cache(device: torch.device) -> None:
    """Give the allocator's unused blocks back to the driver (a CUDA device), so the next shape's check sees them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def prepare_shape(rung: Rung, device: torch.device, dtype: torch.dtype, config: SparseConfig,
                  choices: DenseChoices, echo, sparse_choices: SparseChoices | None) -> dict[str, float]:
    """`prepare`'s work on one shape: its kernels, its dense choice (bf16 and 8-bit bounds), its sparse choice.

    Returns:
        {"kernels_s", "dense_s"} (and "sparse_s" with `sparse_choices`).
    """
    size = rung.size
    start = time.perf_counter()
    compiled = prepare_kernels(size.layout(), config, dtype, device, size.head_dim, size.heads)
    kernels_s = time.perf_counter() - start
    start = time.perf_counter()
    q, k, v = strided_qkv(size.total, size.heads, size.head_dim, dtype, device)
    for precision in ("bf16", "8-bit"):
        kernel = choices.choice(q, k, v, precision=precision)
    del q, k, v
    synchronize(device)
    dense_s = time.perf_counter() - start
    echo(f"prepare {rung.name} ({size.total:,} tokens): kernels "
         + ("already prepared" if compiled is None else f"ready in {kernels_s:.1f} s")
         + f"; dense attention on {choices.label(kernel)} (measured in {dense_s:.1f} s)")
    result = {"kernels_s": kernels_s, "dense_s": dense_s}
    if sparse_choices is not None:
        result["sparse_s"] = measure_sparse(rung, device, dtype, config, sparse_choices, echo)
    return result


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (a CUDA device; the CPU has none)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_sparse(rung: Rung, device: torch.device, dtype: torch.dtype, config: SparseConfig,
                   choices: SparseChoices, echo) -> float:
    """Measure (or check the saved) sparse-kernel choice of one sparse call of `rung` under `config` at every
    ratio class (`RATIO_CLASSES`: a run whose ratio moves, with an error target or a ramped warmup, meets no
    other), for the bf16 bound and the 8-bit one (a launch with 8-bit attention runs the latter); seconds."""
    size = rung.size
    start = time.perf_counter()
    g = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(1, size.heads, size.total, size.head_dim, generator=g, device=device, dtype=dtype)
               for _ in range(3))
    ran: dict[str, list[str]] = {}
    layout = size.layout()
    for ratio in RATIO_CLASSES:
        for precision in ("bf16", "8-bit"):
            sparse_attention(q, k, v, layout, config.replace(topk_ratio=ratio, precision=precision), choices=choices,
                             ran=lambda name, summary: ran.setdefault(f"{name} ({precision} bound)", []).append(
                                 f"{ratio:g}"))
    del q, k, v
    synchronize(device)
    seconds = time.perf_counter() - start
    echo(f"prepare {rung.name}: sparse attention runs on "
         + "; ".join(f"{name} at ratio classes {', '.join(classes)}" for name, classes in ran.items())
         + f" (chosen in {seconds:.1f} s)")
    return seconds


def parser() -> argparse.ArgumentParser:
    """The command's own parser (install.py runs the command with its defaults)."""
    p = argparse.ArgumentParser(prog="python -m adaptive_sparse_attention prepare", description=__doc__.splitlines()[0])
    add_arguments(p)
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="the longest clip whose kernels are compiled (1344x768; default 60)")
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="the model's compute dtype")
    parser.add_argument("--device", default="cuda", help="the CUDA device (default cuda)")
    parser.add_argument("--user-dir", help="ComfyUI's user directory, where the node keeps its dense-kernel "
                                           "choices (default: found from the pack's folder inside ComfyUI)")


def run(args: argparse.Namespace) -> int:
    """The `prepare` command."""
    if not 2.0 <= args.max_seconds <= 120.0:
        print(f"prepare: --max-seconds {args.max_seconds:g} is not allowed: 2 to 120")
        return 2
    if not torch.cuda.is_available():
        print("prepare: no CUDA GPU visible: nothing to prepare (on the CPU the torch reference kernel runs, "
              "which compiles nothing)")
        return 0
    device = torch.device(args.device)
    pack_dir = Path(__file__).resolve().parent.parent
    user_dir = Path(args.user_dir) if args.user_dir else comfy_user_dir(pack_dir)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shapes = rungs(args.max_seconds)
    print(f"prepare: compiling the sparse-attention kernels for {torch.cuda.get_device_name(device)} and measuring "
          f"the dense and sparse kernels at {len(shapes)} shapes (clips up to {args.max_seconds:g} s); about a "
          "minute or two the first time on a machine")
    choices = DenseChoices(default_cache_path(user_dir))
    prepare(shapes, device, DTYPES[args.dtype], SparseConfig(), choices,
            sparse_choices=SparseChoices(sparse_cache_path(user_dir)))
    from ..kernels.dense.pays_from import describe
    from .pays_from import ladder, measure

    try:
        value, _ = measure(ladder(), device, DTYPES[args.dtype], SparseConfig(), choices)
    except torch.OutOfMemoryError as err:
        print(f"prepare: from which size sparse attention pays is not measured: out of memory ({describe_error(err)})")
        return 0
    print(f"prepare: {describe(value)}; saved in {choices.path}")
    return 0
