"""Prepare a machine ahead of the first run: compile the kernels, measure the dense- and sparse-kernel choices.

The first sparse use on a machine compiles the Triton kernels, the first dense block of a shape
measures which exact dense kernel is fastest, and the first sparse block which sparse kernel is
(`kernel="auto"`). The results persist (Triton's disk cache, the choice files), so doing them here,
once, takes the wait out of the first sampler run. The command also measures from which clip length
sparse attention pays on this GPU (bench/pays_from.py), which the node names when a run is too small
for it.
`python -m adaptive_sparse_attention prepare` runs it; `install.py` runs it too when it finds a
GPU. H3's shapes at 1344x768: the kernels depend on the clip length only through row buckets (three
per power of two of the key blocks, `kernels/triton/radix_select.row_split`), so the 5 s and 10 s clips
cover the lengths near them; another length builds its bucket's two small kernels once per machine.
``--shape SPEC`` compiles the kernels of one run's exact shape instead (the child process `nodes/warm_start.py` starts during a run's dense
warmup steps, or, with ``--shape -``, when the node patches a model: it then reads the shape from its
input); it measures nothing. Both build the Triton kernels side by side, a thread per core
(``--build-threads``; `kernels/triton/build_ahead.py`).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from ..backend.attention import sparse_attention
from ..backend.config import SparseConfig
from ..backend.layout import SequenceLayout
from ..backend.warmup import prepare_kernels
from ..kernels.dense.choice import DenseChoices, default_cache_path
from ..kernels.sparse_choice.choice import SparseChoices
from ..kernels.sparse_choice.choice import default_cache_path as sparse_cache_path
from ..nodes.warm_start import STANDBY_LINE, STANDBY_SPEC, UP_LINE
from ..notices import logger
from .scenes import SIZES, strided_qkv

log = logger()
CLIPS = {"5s": "h3-5s", "10s": "h3-10s", "14s": "h3-14s", "30s": "h3-30s"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def comfy_user_dir(pack_dir: Path) -> Path | None:
    """ComfyUI's default user directory when the pack sits in ``ComfyUI/custom_nodes/<folder>``."""
    if pack_dir.parent.name == "custom_nodes" and (pack_dir.parent.parent / "main.py").is_file():
        return pack_dir.parent.parent / "user"
    return None


def prepare(clips: list[str], device: torch.device, dtype: torch.dtype, config: SparseConfig,
            choices: DenseChoices, echo=print, sparse_choices: SparseChoices | None = None,
            build_threads: int = 0) -> dict[str, dict[str, float]]:
    """Compile the kernels of `config` and measure the dense choice (and the sparse one) for each H3 clip.

    Args:
        clips: names in `CLIPS`.
        device: a CUDA device.
        dtype: the model's compute dtype.
        config: the sparse configuration whose kernels are compiled (the node's defaults).
        choices: where the dense choices are measured and saved.
        echo: prints one line per step.
        sparse_choices: where the sparse choice of `config` is measured and saved (None: not measured).
        build_threads: Triton builds at once (`prepare_kernels`; 0: one after the other, at launch).
    Returns:
        clip -> {"kernels_s", "dense_s"} (and "sparse_s" with `sparse_choices`).
    """
    result = {}
    for clip in clips:
        size = SIZES[CLIPS[clip]]
        start = time.perf_counter()
        compiled = prepare_kernels(size.layout(), config, dtype, device, size.head_dim, size.heads,
                                   build_threads=build_threads)
        kernels_s = time.perf_counter() - start
        echo(f"prepare {clip} ({size.total} tokens): sparse kernels "
             + ("already prepared" if compiled is None else f"ready in {kernels_s:.1f} s"))
        start = time.perf_counter()
        q, k, v = strided_qkv(size.total, size.heads, size.head_dim, dtype, device)
        kernel = choices.choice(q, k, v)
        del q, k, v
        torch.cuda.synchronize(device)
        dense_s = time.perf_counter() - start
        echo(f"prepare {clip}: dense attention runs on {choices.label(kernel)} (measured in {dense_s:.1f} s, "
             f"saved in {choices.path}; ComfyUI's own attention, a candidate too, is measured in its first run)")
        result[clip] = {"kernels_s": kernels_s, "dense_s": dense_s}
        if sparse_choices is not None:
            result[clip]["sparse_s"] = measure_sparse(size, device, dtype, config, sparse_choices, echo, clip)
    return result


def measure_sparse(size, device: torch.device, dtype: torch.dtype, config: SparseConfig, choices: SparseChoices,
                   echo, clip: str) -> float:
    """Measure (or check the saved) sparse-kernel choice of one sparse call of `size` under `config`, for the
    bf16 bound and the 8-bit one (a launch with 8-bit attention runs the latter); seconds."""
    start = time.perf_counter()
    g = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(1, size.heads, size.total, size.head_dim, generator=g, device=device, dtype=dtype)
               for _ in range(3))
    ran: list[str] = []
    layout = size.layout()
    for precision in ("bf16", "8-bit"):
        sparse_attention(q, k, v, layout, config.replace(precision=precision), choices=choices,
                         ran=lambda name, summary: ran.append(f"{name} ({precision} bound)"))
    del q, k, v
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    echo(f"prepare {clip}: sparse attention runs on {', '.join(ran)} (chosen in {seconds:.1f} s, saved in "
         f"{choices.path})")
    return seconds


SPEC_FIELDS = ("segments", "config", "dtype", "head_dim", "heads", "device")
SHAPE_BUDGET_S = 600  # a --shape run still going after this exits with 1 (no parent need be there to stop it)
STANDBY_WAIT_S = 900  # a standby child (--shape -) no shape came to after this exits (its parent starts another)


def prepare_shape(spec: str, echo=print, build_threads: int = 0) -> float | None:
    """Compile (or load from Triton's cache) the kernels of one run's shape (`prepare_kernels`).

    Args:
        spec: JSON with "segments" ([start, stop, kind, grid or null] rows), "config" (SparseConfig fields),
            "dtype" (a `DTYPES` value's name), "head_dim", "heads" and "device" (written by
            `nodes.warm_start.shape_spec`).
        echo: prints one line.
        build_threads: Triton builds at once (`prepare_kernels`; 0: one after the other, at launch).
    Returns:
        Seconds spent, or None when nothing compiles for this shape.
    """
    fields = json.loads(spec)
    if not isinstance(fields, dict) or sorted(fields) != sorted(SPEC_FIELDS):
        raise ValueError(f"prepare --shape: {spec[:200]!r} is not allowed: a JSON object with exactly the keys "
                         f"{', '.join(SPEC_FIELDS)}")
    dtypes = {str(d).removeprefix("torch."): d for d in DTYPES.values()}
    if fields["dtype"] not in dtypes:
        raise ValueError(f"prepare --shape: dtype={fields['dtype']!r} is not allowed: {', '.join(dtypes)}")
    layout = SequenceLayout.from_segments([(a, b, kind) if grid is None else (a, b, kind, tuple(grid))
                                           for a, b, kind, grid in fields["segments"]])
    device = torch.device(fields["device"])
    echo(f"{UP_LINE} for {layout.total} tokens on {device}")  # the parent's sign that the start-up is over
    seconds = prepare_kernels(layout, SparseConfig(**fields["config"]), dtypes[fields["dtype"]], device,
                              int(fields["head_dim"]), int(fields["heads"]), build_threads=build_threads)
    echo("prepare --shape: " + ("nothing compiles for this shape" if seconds is None else f"ready in {seconds:.1f} s"))
    return seconds


def parser() -> argparse.ArgumentParser:
    """The command's own parser (install.py runs the command with its defaults)."""
    p = argparse.ArgumentParser(prog="python -m adaptive_sparse_attention prepare", description=__doc__.splitlines()[0])
    add_arguments(p)
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clips", default="5s,10s", help=f"H3 clips at 1344x768 ({', '.join(CLIPS)}; default 5s,10s)")
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="the model's compute dtype")
    parser.add_argument("--device", default="cuda", help="the CUDA device (default cuda)")
    parser.add_argument("--user-dir", help="ComfyUI's user directory, where the node keeps its dense-kernel "
                                           "choices (default: found from the pack's folder inside ComfyUI)")
    parser.add_argument("--shape", help="compile the kernels of this one shape (JSON written by the node's child "
                                        "process, nodes/warm_start.py; '-': read it as one line from standard "
                                        "input, after the imports) instead of the clips; measures nothing")
    parser.add_argument("--build-threads", type=int, default=os.cpu_count() or 1,
                        help="Triton kernels built at once after a dry run of the call records them (default: one per "
                             "CPU core; 0: each builds at its first launch, one after the other)")


def run(args: argparse.Namespace) -> int:
    """The `prepare` command."""
    if args.build_threads < 0:
        print(f"prepare: --build-threads {args.build_threads} is not allowed: 0 (one after the other) or more")
        return 2
    if args.shape:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        spec = args.shape
        if spec == STANDBY_SPEC:  # a standby child: imports done, it waits for its run shape (or end of input)
            print(STANDBY_LINE, flush=True)
            idle = threading.Timer(STANDBY_WAIT_S, os._exit, (0,))  # no shape came: the run never started
            idle.daemon = True
            idle.start()
            spec = sys.stdin.readline()
            idle.cancel()
            if not spec.strip():
                return 0  # its parent closed the input: no shape came
        faulthandler.dump_traceback_later(SHAPE_BUDGET_S, exit=True)
        try:
            prepare_shape(spec, build_threads=args.build_threads)
        finally:
            faulthandler.cancel_dump_traceback_later()
        return 0
    clips = [c for c in args.clips.split(",") if c]
    unknown = [c for c in clips if c not in CLIPS]
    if unknown or not clips:
        print(f"prepare: --clips {args.clips!r}: {unknown or 'none given'} not allowed; allowed: {', '.join(CLIPS)}")
        return 2
    if not torch.cuda.is_available():
        print("prepare: no CUDA GPU visible: nothing to prepare (on the CPU the torch reference kernel runs, "
              "which compiles nothing)")
        return 0
    device = torch.device(args.device)
    pack_dir = Path(__file__).resolve().parent.parent
    user_dir = Path(args.user_dir) if args.user_dir else comfy_user_dir(pack_dir)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"prepare: compiling the sparse-attention kernels for {torch.cuda.get_device_name(device)} and measuring "
          f"the dense kernel for {', '.join(clips)}; this takes about a minute the first time on a machine")
    choices = DenseChoices(default_cache_path(user_dir))
    prepare(clips, device, DTYPES[args.dtype], SparseConfig(), choices,
            sparse_choices=SparseChoices(sparse_cache_path(user_dir)), build_threads=args.build_threads)
    from ..kernels.dense.pays_from import describe
    from .pays_from import ladder, measure

    value, _ = measure(ladder(), device, DTYPES[args.dtype], SparseConfig(), choices)
    print(f"prepare: {describe(value)}; saved in {choices.path}")
    return 0
