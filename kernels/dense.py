"""Dense attention on the fastest exact kernel of this GPU at this shape, chosen by measurement.

ComfyUI's SDPA wrapper fixes one backend priority for every GPU (FlashAttention first). Here the
exact candidates (SDPA's cuDNN, FlashAttention and memory-efficient backends: the same softmax
attention, differing in bf16/fp16 rounding only) are checked against a float32 softmax attention
and timed once per GPU, dtype, head size, head count and key-length bucket on a slice of the real
queries; the fastest one that matches is kept. `DenseChoices` owns the choices: in memory
(bounded) and in a small JSON file (`ChoiceFile`), so later processes on the machine take the same
kernel (the same output bits) after one check that it still runs here. On the CPU SDPA's own
choice runs; where no candidate runs, SDPA's own choice runs too, said once and not saved.

SDPA's memory-efficient kernel indexes a head's rows in 32 bits: on ComfyUI's q/k (strided views
of the fused qkv buffer, 3*H*D elements apart) a clip whose rows span 2^31 elements or more (H3
from about 14 s) makes it read out of bounds, which kills the CUDA context instead of raising.
Such inputs are never given to it, neither while measuring nor after.
"""
from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..version import __version__
from .choice_file import ChoiceFile
from .offsets import wide_rows

log = logging.getLogger("adaptive_sparse_attention")

CACHE_ENV = "ADAPTIVE_SPARSE_DENSE_CACHE"
CANDIDATES = ("cudnn", "flash", "efficient")
SAMPLE_ROWS = 4096  # queries timed per candidate: the ranking depends on the keys, not on the query count
CHECK_ROWS = 128  # of those, compared with the float32 reference, in the first and last head
REPS = 3
MAX_CHOICES = 64  # shape buckets kept in memory; a model uses a handful
_UNKNOWN = object()  # no choice in memory yet


def tolerance(dtype: torch.dtype) -> float:
    """Relative L2 error a candidate may have against the float32 reference at this input dtype.

    An exact kernel differs from it by rounding its probabilities and its output to the input
    dtype: a relative RMS error near u/sqrt(3) each, u the unit roundoff (2^-8 for bfloat16, 2^-11
    for float16), so about 3e-3 and 4e-4 together. The bounds are 5-10 times that; a wrong kernel
    (scale, head or row mix-up) is off by 0.1 or more. Float32 and float64 allow TF32-like rounding.

    Args:
        dtype: the dtype of q, k, v.
    Returns:
        The largest relative L2 error accepted.
    """
    return 2e-2 if dtype == torch.bfloat16 else 5e-3 if dtype == torch.float16 else 1e-3


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


def device_key(device: torch.device) -> str:
    """The part of a choice's key fixed per GPU and build: pack, GPU, torch and cuDNN versions.

    Args:
        device: a CUDA device.
    Returns:
        The key prefix.
    """
    sm = "".join(map(str, torch.cuda.get_device_capability(device)))
    return (f"pack {__version__}|{torch.cuda.get_device_name(device)}|sm{sm}|torch {torch.__version__}"
            f"|cudnn {torch.backends.cudnn.version()}")


def default_cache_path(user_dir: str | os.PathLike | None = None) -> Path:
    """Where the measured choices are saved.

    Args:
        user_dir: ComfyUI's user directory, when running inside ComfyUI.
    Returns:
        ``ADAPTIVE_SPARSE_DENSE_CACHE`` if set, else ``<user_dir>/adaptive_sparse_attention/
        dense_choices.json``, else ``adaptive_sparse_attention/dense_kernels.json`` in the user's
        cache folder. A path that cannot hold a file (a folder, ``/``) is warned about when first
        used, and the choices are then kept in memory only.
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    if user_dir is not None:
        return Path(user_dir) / "adaptive_sparse_attention" / "dense_choices.json"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaptive_sparse_attention" / "dense_kernels.json"


def relative_l2(out: torch.Tensor, reference: torch.Tensor) -> float:
    """||out - reference|| / ||reference||, in float32 (synchronises)."""
    return float((out.float() - reference).norm() / reference.norm().clamp_min(1e-30))


def probe(t: torch.Tensor) -> torch.Tensor:
    """The rows candidates are checked on: batch 0, first and last head, CHECK_ROWS spread rows."""
    heads = sorted({0, t.shape[1] - 1})
    return t[0, heads, ::max(1, t.shape[2] // CHECK_ROWS)][:, :CHECK_ROWS]


def reference_attention(sample: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float32 softmax attention of `probe(sample)` against all keys of the same heads."""
    heads = sorted({0, k.shape[1] - 1})
    q32, k32, v32 = probe(sample).float(), k[0, heads].float(), v[0, heads].float()
    weights = torch.softmax(q32 @ k32.transpose(-1, -2) * q32.shape[-1] ** -0.5, dim=-1)
    return weights @ v32


def describe(err: BaseException) -> str:
    """An exception's type and first line, for a log message."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__


def log_note(message: str, level: int = logging.INFO) -> None:
    """Log `message` at `level` (the default `note` of `agrees` and `fastest`)."""
    log.log(level, message)


def agrees(name: str, run: Callable[[str], torch.Tensor], reference: torch.Tensor, tol: float,
           note: Callable[..., None] = log_note) -> bool:
    """Whether candidate `name` runs and matches the reference; why not is passed to `note`.

    Args:
        name: the candidate.
        run: runs one candidate on the sample, returning its output at the reference's rows.
        reference: the float32 reference output.
        tol: the largest relative L2 error accepted.
        note: receives the reason when the answer is no (and, for a mismatch, logging.WARNING).
    Returns:
        True if it ran and matched.
    """
    try:
        err = relative_l2(run(name), reference)
    except Exception as exc:  # out of memory, or a kernel that does not take these inputs
        note(f"dense kernel {name} cannot run here ({describe(exc)}): skipped")
        return False
    if not err <= tol:
        note(f"dense kernel {name} differs from the float32 reference (relative L2 {err:.2e}, more than "
             f"{tol:.0e}): skipped", logging.WARNING)
        return False
    return True


def fastest(candidates: Sequence[str], run: Callable[[str], torch.Tensor],
            time_ms: Callable[[Callable[[], object]], float], reference: torch.Tensor, tol: float,
            note: Callable[..., None] = log_note) -> str | None:
    """The fastest candidate that runs and matches the reference, or None if none does.

    Args:
        candidates: kernel names, in order of preference for equal times.
        run: runs one candidate on the sample, returning its output at the reference's rows.
        time_ms: milliseconds of one call of a thunk (after a warm-up call).
        reference: the float32 reference output.
        tol: the largest relative L2 error accepted.
        note: receives why a candidate is skipped (see `agrees`).
    Returns:
        The chosen name, or None.
    """
    times = {}
    for name in candidates:
        if not agrees(name, run, reference, tol, note):
            continue
        try:
            times[name] = time_ms(lambda: run(name))
        except Exception as exc:
            note(f"dense kernel {name} failed while timed ({describe(exc)}): skipped")
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


class DenseChoices:
    """The dense kernel of each shape bucket: measured, or saved by an earlier process and checked.

    One object per owner (a node's patched model, shared by its clones: the choices are facts of
    the machine, and the object locks its first uses); its memory holds at most MAX_CHOICES buckets. A
    choice in memory is read without a lock or host synchronisation, so compiled dense blocks do
    not break their graph there; the first use of a bucket (reading the file, checking, measuring)
    runs outside torch.compile, under the object's lock.

    Args:
        path: the JSON file of saved choices; None: `default_cache_path()`.
    """

    def __init__(self, path: Path | None = None):
        self.file = ChoiceFile(default_cache_path() if path is None else path)
        self.lock = threading.Lock()
        self.choices: dict[str, str | None] = {}
        self.devices: dict[int | None, str] = {}  # device index -> device_key
        self.noted: set[str] = set()

    @property
    def path(self) -> Path:
        """The JSON file of saved choices."""
        return self.file.path

    def reset(self) -> None:
        """Forget the choices in memory (the file keeps them) and the messages already logged."""
        with self.lock:
            self.choices.clear()
            self.noted.clear()

    def note(self, message: str, level: int = logging.INFO) -> None:
        """Log `message` once per object (at most MAX_CHOICES distinct messages are remembered)."""
        if message in self.noted:
            return
        if len(self.noted) < MAX_CHOICES:
            self.noted.add(message)
        log.log(level, message)

    def key(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
        """What the choice depends on: `device_key`, dtype, head size, heads, key-length bucket, and
        whether the rows are too wide for the memory-efficient kernel."""
        device = self.devices.get(q.device.index)
        if device is None:
            device = self.describe_device(q.device)
        bucket = 1 << max(0, math.ceil(math.log2(max(1, k.shape[2]))))
        wide = "|wide rows" if wide_rows(q, k, v) else ""
        return f"{device}|{q.dtype}|D{q.shape[-1]}|H{q.shape[1]}|keys<={bucket}{wide}"

    @torch.compiler.disable
    def describe_device(self, device: torch.device) -> str:
        """`device_key` of `device`, computed once per device (outside torch.compile)."""
        self.devices[device.index] = device_key(device)
        return self.devices[device.index]

    def lookup(self, key: str, first_use: Callable[[], str | None]) -> str | None:
        """The choice in memory for `key` (read without a lock), else `first_use()`."""
        choice = self.choices.get(key, _UNKNOWN)
        return first_use() if choice is _UNKNOWN else choice

    def resolve(self, key: str, allowed: Sequence[str], check: Callable[[str], bool],
                measure: Callable[[], str | None]) -> str | None:
        """First use of `key`: the saved choice if `check` passes for it, else `measure()`.

        A measured choice is saved; None (no candidate ran) is kept for this process only, so a
        later process measures again.

        Args:
            key: the shape bucket.
            allowed: the kernels these inputs may run on.
            check: whether a kernel runs here and matches the reference (False where it cannot be told).
            measure: the fastest matching kernel, or None.
        Returns:
            The kernel, or None for SDPA's own choice.
        """
        with self.lock:
            choice = self.choices.get(key, _UNKNOWN)
            if choice is not _UNKNOWN:
                return choice
            saved = self.file.read().get(key)
            if saved is not None and saved in allowed and check(saved):
                return self.remember(key, saved)
            if saved is not None:
                self.note(f"the saved dense kernel {saved!r} for {key} does not run or match here: measuring again")
            choice = measure()
            if choice is None:
                self.note(f"dense attention for {key} runs on SDPA's own choice: no candidate kernel ran and "
                          "matched here; a later process measures again", logging.WARNING)
            else:
                log.info("dense attention for %s runs on SDPA's %s kernel (measured once, saved in %s)",
                         key, choice, self.path)
                self.file.save(key, choice)
            return self.remember(key, choice)

    def remember(self, key: str, choice: str | None) -> str | None:
        """Keep `choice` in memory, dropping the oldest beyond MAX_CHOICES."""
        self.choices[key] = choice
        while len(self.choices) > MAX_CHOICES:
            del self.choices[next(iter(self.choices))]
        return choice

    @torch.compiler.disable
    def first_use(self, key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
        """`resolve` on these inputs: candidates checked and timed on the first SAMPLE_ROWS queries."""
        allowed = candidates(q, k, v)
        sample = q[:, :, :SAMPLE_ROWS]
        tol = tolerance(q.dtype)

        def run(name: str) -> torch.Tensor:
            return probe(sdpa(sample, k, v, name))

        with torch.cuda.device(q.device), torch.no_grad():
            try:
                reference = reference_attention(sample, k, v)
            except Exception as exc:  # out of memory: no candidate can be checked
                self.note(f"the float32 reference for {key} cannot run here ({describe(exc)})", logging.WARNING)
                reference = None
            return self.resolve(
                key, allowed,
                lambda name: reference is not None and agrees(name, run, reference, tol, self.note),
                lambda: None if reference is None else fastest(allowed, run, cuda_time_ms, reference, tol,
                                                               self.note))

    def choice(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
        """The kernel for dense attention of these inputs: measured on first use of a shape bucket.

        Returns:
            The kernel, or None where SDPA's own choice runs (CPU, or no candidate ran).
        """
        if not q.is_cuda:
            return None
        key = self.key(q, k, v)
        return self.lookup(key, lambda: self.first_use(key, q, k, v))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Exact softmax attention of q, k, v [B, H, S, D] on the fastest kernel for them.

        Args:
            q, k, v: one dtype and device; scale head_dim ** -0.5, no mask.
        Returns:
            [B, H, S, D] in q's dtype.
        """
        choice = self.choice(q, k, v)
        if choice is None and q.is_cuda and wide_rows(q, k, v):  # SDPA's own pick may be memory-efficient
            q, k, v = (t.contiguous() for t in (q, k, v))
        return sdpa(q, k, v, choice)
