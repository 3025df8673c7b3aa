"""Dense attention on the fastest exact kernel of this GPU at this shape, chosen by measurement.

ComfyUI's SDPA wrapper fixes one backend priority for every GPU (FlashAttention first). Here the
exact candidates (SDPA's cuDNN, FlashAttention and memory-efficient backends: the same softmax
attention, differing in bf16/fp16 rounding only) are timed once per GPU, dtype, head size,
head count and key-length bucket on a slice of the real queries, and the fastest one that agrees
with the others is kept. The choice is cached in memory and in a small JSON file, so later
processes on the machine take the same kernel (the same output bits) without measuring again.
On the CPU SDPA's own choice runs.

SDPA's memory-efficient kernel indexes a head's rows in 32 bits: on ComfyUI's q/k (strided views
of the fused qkv buffer, 3*H*D elements apart) a clip whose rows span 2^31 elements or more (H3
from about 14 s) makes it read out of bounds, which kills the CUDA context instead of raising.
Such inputs are never given to it, neither while measuring nor after.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .offsets import wide_rows

log = logging.getLogger("adaptive_sparse_attention")

CACHE_ENV = "ADAPTIVE_SPARSE_DENSE_CACHE"
CANDIDATES = ("cudnn", "flash", "efficient")
SAMPLE_ROWS = 4096  # queries timed per candidate: the ranking depends on the keys, not on the query count
REPS = 3
AGREE_REL_L2 = 2e-2  # a few bf16 roundings (2^-8 each) of outputs of unit scale
_lock = threading.Lock()
_choices: dict[str, str | None] = {}


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str | None) -> torch.Tensor:
    """SDPA of [B, H, S, D] inputs on one named backend (None: SDPA's own choice)."""
    if kernel is None:
        return F.scaled_dot_product_attention(q, k, v)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_backend(kernel)]):
        return F.scaled_dot_product_attention(q, k, v)


def candidates(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[str, ...]:
    """The kernels that can take these inputs: all but memory-efficient where the rows are wide."""
    return tuple(c for c in CANDIDATES if c != "efficient") if wide_rows(q, k, v) else CANDIDATES


def shape_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """What the choice depends on: GPU, library versions, dtype, head size, heads, key-length
    bucket, and whether the rows are too wide for the memory-efficient kernel."""
    device = q.device
    bucket = 1 << max(0, math.ceil(math.log2(max(1, k.shape[2]))))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    wide = "|wide rows" if wide_rows(q, k, v) else ""
    return (f"{torch.cuda.get_device_name(device)}|sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
            f"|torch {torch.__version__}|cudnn {cudnn}|{q.dtype}|D{q.shape[-1]}|H{q.shape[1]}|keys<={bucket}{wide}")


def fastest(candidates: Sequence[str], run: Callable[[str], torch.Tensor],
            time_ms: Callable[[Callable[[], object]], float]) -> str | None:
    """The fastest candidate whose output agrees with the first that runs, or None if none runs.

    Args:
        candidates: kernel names, in order of preference for equal times.
        run: runs one candidate on the sample and returns its output (raises if it cannot run).
        time_ms: milliseconds of one call of a thunk (after a warm-up call).
    Returns:
        The chosen name, or None.
    """
    reference, first, times = None, None, {}
    for name in candidates:
        try:
            out = run(name)
        except RuntimeError as err:  # this backend does not take these inputs
            log.debug("dense kernel %s cannot run here: %s", name, err)
            continue
        if reference is None:
            reference, first = out.float(), name
        else:
            err = float((out.float() - reference).norm() / reference.norm().clamp_min(1e-30))
            if not err <= AGREE_REL_L2:
                log.warning("dense kernel %s disagrees with %s (relative L2 %.2e): not used",
                            name, first, err)
                continue
        times[name] = time_ms(lambda: run(name))
    if not times:
        return None
    return min(times, key=lambda name: (times[name], candidates.index(name)))


def cuda_time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of `fn` over REPS calls, timed with CUDA events (synchronises)."""
    fn()
    spans = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        spans.append(start.elapsed_time(end))
    return sorted(spans)[len(spans) // 2]


def cache_path() -> Path:
    """The JSON file of measured choices (``ADAPTIVE_SPARSE_DENSE_CACHE`` overrides it)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaptive_sparse_attention" / "dense_kernels.json"


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, choice: str | None) -> None:
    try:
        data = _read_cache(path)
        data[key] = choice
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as err:
        log.warning("could not save the dense-kernel choice to %s (%s); it is measured again next process",
                    path, err)


def cached_choice(key: str, measure: Callable[[], str | None], allowed: Sequence[str] = CANDIDATES) -> str | None:
    """The choice stored for `key` (in memory, else in the cache file, if one of `allowed`), else
    `measure()`, stored.

    A choice already in memory is read without the lock: torch.compile cannot trace a lock, so
    every compiled dense block would break its graph here."""
    if key in _choices:
        return _choices[key]
    with _lock:
        if key in _choices:
            return _choices[key]
        path = cache_path()
        stored = _read_cache(path).get(key, "")
        if stored is None or stored in allowed:
            _choices[key] = stored
            return stored
        choice = _choices[key] = measure()
        log.info("dense attention for %s runs on SDPA's %s kernel (measured once, saved in %s)",
                 key, choice or "default", path)
        _write_cache(path, key, choice)
        return choice


def dense_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """The kernel for dense attention of these inputs: measured on first use of a shape bucket.

    Returns None where SDPA's own choice runs (CPU, or no candidate could run).
    """
    if not q.is_cuda:
        return None
    sample = q[:, :, :SAMPLE_ROWS]
    allowed = candidates(q, k, v)

    def measure() -> str | None:
        with torch.cuda.device(q.device):
            return fastest(allowed, lambda name: sdpa(sample, k, v, name), cuda_time_ms)

    return cached_choice(shape_key(q, k, v), measure, allowed)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention of q, k, v [B, H, S, D] on the fastest kernel for them.

    Args:
        q, k, v: one dtype and device; scale head_dim ** -0.5, no mask.
    Returns:
        [B, H, S, D] in q's dtype.
    """
    choice = dense_choice(q, k, v)
    if choice is None and q.is_cuda and wide_rows(q, k, v):  # SDPA's own pick may be memory-efficient
        q, k, v = (t.contiguous() for t in (q, k, v))
    return sdpa(q, k, v, choice)
