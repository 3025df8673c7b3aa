"""Dense attention on the fastest kernel of this GPU at this shape that meets the run's precision.

ComfyUI's SDPA wrapper fixes one backend priority for every GPU (FlashAttention first), and a user
may have launched ComfyUI with a faster attention (comfy-kitchen INT8, Sage, flash-attn, ...). Here
the candidates (SDPA's cuDNN, FlashAttention and memory-efficient backends, the dense kernels
families offer where they run, `registry.DENSE_KERNELS`: FlashAttention-4 on sm90/sm100, and the
host's own attention function, `HostAttention`: ComfyUI's as launched) are checked against a
float32 softmax attention and timed once per GPU, dtype, head size, head count, key-length bucket,
precision and host function on a slice of the real queries; the fastest one that meets the
precision's bound (`tolerance`) is kept, so a steady dense step is not slower than the host's own
attention (a kernel's first use in a process may be). `DenseChoices` owns the choices: in memory (bounded) and in a small
JSON file (`ChoiceFile`), so later processes on the machine take the same kernel (the same output
bits) after one check that it still runs here. On the CPU SDPA's own choice runs unless a host
function is given (then the two are measured); where no candidate runs, SDPA's own choice runs
too, said once and not saved.

SDPA's memory-efficient kernel indexes a head's rows in 32 bits: on ComfyUI's q/k (strided views
of the fused qkv buffer, 3*H*D elements apart) a clip whose rows span 2^31 elements or more (H3
from about 14 s) makes it read out of bounds, which kills the CUDA context instead of raising.
Such inputs are never given to it, neither while measuring nor after.
A sticky CUDA error (`cuda_errors.poisons_context`) while a candidate is checked or timed is not skipped: the
measurement stops with it, since every later candidate would fail on the lost context.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ...errors import SparseAttentionError
from ...notices import Notices, logger
from ...timer import median_ms
from ...version import __version__
from ..cuda_errors import poisons_context
from ..offsets import wide_rows
from ..registry import DENSE_KERNELS
from .store import MAX_CHOICES, ChoiceFile, Remembered, choice_path

log = logger()

CACHE_ENV = "ADAPTIVE_SPARSE_DENSE_CACHE"
CANDIDATES = ("cudnn", "flash", "efficient")  # SDPA's backends on CUDA
DEFAULT = "sdpa"  # SDPA's own choice: the CPU's candidate
HOST = "host"  # the host application's own attention function (`HostAttention`)
# host functions that are SDPA itself (ComfyUI's default attention: SDPA with FlashAttention first): `prepare`
# measured every SDPA backend for the bucket, so the choice it saved is at least as fast, and is taken untimed
SDPA_HOSTS = ("comfy.ldm.modules.attention.attention_pytorch",)
PRECISIONS = ("bf16", "8-bit")
BF16_MULTIPLE = 3  # bound of a bf16 run, in units of an exact kernel's rounding error (`tolerance`)
EIGHT_BIT_MULTIPLE = 10  # bound of an 8-bit run, likewise
LABELS = {"cudnn": "SDPA cuDNN", "flash": "SDPA FlashAttention-2", "efficient": "SDPA memory-efficient",
          DEFAULT: "SDPA's own choice", **{d.name: d.label for d in DENSE_KERNELS}}
SAMPLE_ROWS = 4096  # queries timed per candidate: the ranking depends on the keys, not on the query count
CHECK_ROWS = 128  # of those, compared with the float32 reference, in the first and last head
REPS = 3
_UNKNOWN = object()  # no choice in memory yet


class ReentryError(RuntimeError):
    """A candidate re-entered the dense choice that is measuring it (it would wait on its own lock)."""


@dataclass(frozen=True)
class HostAttention:
    """The attention function the host application would run for a call (ComfyUI's as launched, or
    another node's patch of it): a candidate of the dense choice like the kernels here.

    Attributes:
        identity: a stable name of the function (module and qualified name), part of the choice's key,
            so a relaunch with another attention measures again.
        run: q, k, v [B, H, S, D] -> [B, H, S, D], exact softmax attention up to its arithmetic.
        eight_bit: whether it computes in 8-bit arithmetic; it is then a candidate of 8-bit runs only.
        label: how the report names it.
    """

    identity: str
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    eight_bit: bool = False
    label: str = ""

    def name(self) -> str:
        """The report's name of the function."""
        return self.label or f"the host's attention {self.identity}"


def rounding_error(dtype: torch.dtype) -> float:
    """Relative L2 error of an exact kernel against a float32 reference from rounding alone.

    Rounding its probabilities and its output to the input dtype gives a relative RMS error near
    u/sqrt(3) each, u the unit roundoff: u * sqrt(2/3) together, 3.2e-3 for bfloat16 (u = 2^-8) and
    4e-4 for float16 (2^-11). Float32 and float64 inputs allow TF32's 2^-11 as well.
    """
    return (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11) * math.sqrt(2.0 / 3.0)


def tolerance(dtype: torch.dtype, precision: str = "bf16", sdpa_error: float | None = None) -> float:
    """Relative L2 error a candidate may have against the float32 reference in a run of `precision`.

    The unit is the error of an exact kernel at this dtype: SDPA's own, measured on the same rows
    (`sdpa_error`), held between `rounding_error(dtype)` and twice that. A bf16 run accepts
    BF16_MULTIPLE units (bfloat16: 9.6e-3: room for exact kernels, not for 8-bit ones). An 8-bit run
    accepts EIGHT_BIT_MULTIPLE units (bfloat16: 3.2e-2: room for 8-bit kernels such as comfy-kitchen
    INT8 and Sage; their measured errors are in docs/performance-notes.md). A wrong kernel (scale, head or row mix-up) is off by 0.1 or more in either.

    Args:
        dtype: the dtype of q, k, v.
        precision: "bf16" or "8-bit".
        sdpa_error: SDPA's own relative L2 error on the checked rows, when measured.
    Returns:
        The largest relative L2 error accepted.
    """
    if precision not in PRECISIONS:
        raise SparseAttentionError(f"precision={precision!r} is not allowed: expected one of {', '.join(PRECISIONS)}")
    unit = rounding_error(dtype)
    if sdpa_error is not None:
        unit = min(max(sdpa_error, unit), 2 * unit)
    return (EIGHT_BIT_MULTIPLE if precision == "8-bit" else BF16_MULTIPLE) * unit


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str | None) -> torch.Tensor:
    """SDPA of [B, H, S, D] inputs on one named backend (None or DEFAULT: SDPA's own choice)."""
    if kernel is None or kernel == DEFAULT:
        return F.scaled_dot_product_attention(q, k, v)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_backend(kernel)]):
        return F.scaled_dot_product_attention(q, k, v)


def candidates(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[str, ...]:
    """SDPA's backends that can take these inputs: all but memory-efficient where the rows are wide."""
    return tuple(c for c in CANDIDATES if c != "efficient") if wide_rows(q, k, v) else CANDIDATES


def device_key(device: torch.device) -> str:
    """The part of a choice's key fixed per GPU and build: pack, GPU, CUDA driver, torch, cuDNN and Triton
    versions. A choice saved under another build is not found, so it is measured again, not trusted.

    Args:
        device: a CUDA device.
    Returns:
        The key prefix.
    """
    sm = "".join(map(str, torch.cuda.get_device_capability(device)))
    return (f"pack {__version__}|{torch.cuda.get_device_name(device)}|sm{sm}|driver {driver_version()}"
            f"|torch {torch.__version__}|cudnn {torch.backends.cudnn.version()}|triton {triton_version()}")


def driver_version() -> str:
    """The CUDA driver's API version (``cuDriverGetVersion``, e.g. 13000), read in this process; "unknown"
    where the driver library cannot be loaded."""
    import ctypes
    import sys

    try:
        cuda = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        value = ctypes.c_int()
        return str(value.value) if cuda.cuDriverGetVersion(ctypes.byref(value)) == 0 else "unknown"
    except (OSError, AttributeError):
        return "unknown"


def triton_version() -> str:
    """The installed Triton's version (``triton`` or ``triton-windows``), or "none"."""
    from importlib import metadata

    for dist in ("triton", "triton-windows"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "none"


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
    return choice_path(CACHE_ENV, user_dir, "dense_choices.json", "dense_kernels.json")


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
           note: Callable[..., None] = log_note, label: Callable[[str], str] = str) -> bool:
    """Whether candidate `name` runs and matches the reference; why not is passed to `note`.

    Args:
        name: the candidate.
        run: runs one candidate on the sample, returning its output at the reference's rows.
        reference: the float32 reference output.
        tol: the largest relative L2 error accepted.
        note: receives the reason when the answer is no (and, for a mismatch, logging.WARNING).
        label: the candidate's name in messages.
    Returns:
        True if it ran and matched.
    """
    try:
        err = relative_l2(run(name), reference)
    except Exception as exc:  # out of memory, or a kernel that does not take these inputs
        if poisons_context(exc):  # a lost CUDA context: every later candidate would fail too
            raise
        note(f"dense kernel {label(name)} cannot run here ({describe(exc)}): skipped",
             logging.WARNING if isinstance(exc, ReentryError) else logging.INFO)
        return False
    if not err <= tol:
        note(f"dense kernel {label(name)} differs from the float32 reference (relative L2 {err:.2e}, more than "
             f"the {tol:.1e} allowed): skipped", logging.WARNING)
        return False
    return True


def fastest(candidates: Sequence[str], run: Callable[[str], torch.Tensor],
            time_ms: Callable[[Callable[[], object]], float], reference: torch.Tensor, tol: float,
            note: Callable[..., None] = log_note, label: Callable[[str], str] = str,
            times: dict[str, float] | None = None) -> str | None:
    """The fastest candidate that runs and matches the reference, or None if none does.

    Args:
        candidates: kernel names, in order of preference for equal times.
        run: runs one candidate on the sample, returning its output at the reference's rows.
        time_ms: milliseconds of one call of a thunk (after a warm-up call).
        reference: the float32 reference output.
        tol: the largest relative L2 error accepted.
        note: receives why a candidate is skipped (see `agrees`).
        label: a candidate's name in messages.
        times: filled with the milliseconds of every candidate that matched, when given.
    Returns:
        The chosen name, or None.
    """
    times = {} if times is None else times
    for name in candidates:
        if not agrees(name, run, reference, tol, note, label):
            continue
        try:
            times[name] = time_ms(lambda: run(name))
        except Exception as exc:
            if poisons_context(exc):
                raise
            note(f"dense kernel {label(name)} failed while timed ({describe(exc)}): skipped")
    if not times:
        return None
    return min(times, key=lambda name: (times[name], candidates.index(name)))


def exact_error(run: Callable[[str], torch.Tensor], reference: torch.Tensor, allowed: Sequence[str]) -> float | None:
    """The relative L2 error of an exact kernel against the reference: the first of SDPA's kernels in
    `allowed` that runs (its own choice on the CPU); None if none runs."""
    for name in (n for n in allowed if n in CANDIDATES or n == DEFAULT):
        try:
            return relative_l2(run(name), reference)
        except Exception:  # a backend that does not take these inputs: the next one
            continue
    return None


class DenseChoices(Remembered):
    """The dense kernel of each shape bucket: measured, or saved by an earlier process and checked.

    One object per owner (a node's patched model, shared by its clones: the choices are facts of
    the machine, and the object locks its first uses); its memory holds at most MAX_CHOICES buckets. A
    choice in memory is read without a lock or host synchronisation, so compiled dense blocks do
    not break their graph there; the first use of a bucket (reading the file, checking, measuring)
    runs outside torch.compile, under the object's lock, inside `paused`.

    Args:
        path: the JSON file of saved choices; None: `default_cache_path()`.
        timer: milliseconds of one call of a thunk; None: CUDA events on a GPU, the wall clock on the CPU.
        paused: a context the first use of a bucket runs in: the host's allocation record paused (ComfyUI's
            allocation graph), so the measurement's scratch and compiled kernels' buffers are not replayed.
    """

    def __init__(self, path: Path | None = None, timer: Callable[[Callable[[], object]], float] | None = None,
                 paused: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.file = ChoiceFile(default_cache_path() if path is None else path)
        self.timer = timer
        self.paused = paused
        self.lock = threading.Lock()
        self.choices: dict[str, str | None] = {}
        self.devices: dict[int | None, str] = {}  # device index -> device_key (+ the offered dense kernels that run)
        self.notices = Notices(limit=MAX_CHOICES)  # what was logged, once per object
        self.measuring: int | None = None  # the thread measuring a first use, while it does

    @property
    def path(self) -> Path:
        """The JSON file of saved choices."""
        return self.file.path

    def reset(self) -> None:
        """Forget the choices in memory (the file keeps them) and the messages already logged."""
        with self.lock:
            self.choices.clear()
            self.notices.clear()

    def note(self, message: str, level: int = logging.INFO) -> None:
        """Log `message` once per object (at most MAX_CHOICES distinct messages are remembered)."""
        self.notices.say(message, level)

    def key(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, host: HostAttention | None = None,
            precision: str = "bf16") -> str:
        """What the choice depends on: `device_key` (and which offered dense kernels run there), dtype,
        head size, heads, key-length bucket, whether the rows are too wide for the memory-efficient
        kernel, the precision and the host's attention function."""
        device = self.devices.get(q.device.index)
        if device is None:
            device = self.describe_device(q.device)
        bucket = 1 << max(0, math.ceil(math.log2(max(1, k.shape[2]))))
        wide = "|wide rows" if wide_rows(q, k, v) else ""
        return (f"{device}|{q.dtype}|D{q.shape[-1]}|H{q.shape[1]}|keys<={bucket}{wide}|{precision}"
                f"|host {'none' if host is None else host.identity}")

    @torch.compiler.disable
    def describe_device(self, device: torch.device) -> str:
        """`device_key` of `device` (for the CPU: pack and torch versions), computed once per device
        (outside torch.compile)."""
        if device.type != "cuda":
            self.devices[device.index] = f"pack {__version__}|{device.type}|torch {torch.__version__}"
            return self.devices[device.index]
        probe_q = torch.empty(0, device=device, dtype=torch.bfloat16)
        runs = "".join(f"|{d.name}" for d in DENSE_KERNELS if d.unavailable(probe_q) is None)
        self.devices[device.index] = device_key(device) + runs
        return self.devices[device.index]

    def lookup(self, key: str, first_use: Callable[[], str | None]) -> str | None:
        """The choice in memory for `key` (read without a lock), else `first_use()`.

        Raises:
            ReentryError: a candidate being measured by this thread asks for a choice (it would wait on
                the lock its own measurement holds).
        """
        choice = self.choices.get(key, _UNKNOWN)
        if choice is not _UNKNOWN:
            return choice
        if self.measuring == threading.get_ident():
            raise ReentryError(f"a candidate called the dense attention again while it was being measured, for {key} "
                               "(a host attention function that calls ComfyUI's attention without passing "
                               "_inside_attn_wrapper): it cannot be a candidate")
        return first_use()

    def resolve(self, key: str, allowed: Sequence[str], check: Callable[[str], bool],
                measure: Callable[[], str | None], label: Callable[[str], str] = str,
                persist: bool = True) -> str | None:
        """First use of `key`: the saved choice if `check` passes for it, else `measure()`.

        A measured choice is saved (with `persist`); None (no candidate ran) is kept for this process
        only, so a later process measures again.

        Args:
            key: the shape bucket.
            allowed: the kernels these inputs may run on.
            check: whether a kernel runs here and matches the reference (False where it cannot be told).
            measure: the fastest matching kernel, or None.
            label: a kernel's name in messages.
            persist: whether the file is read and written (not for CPU timings, which vary run to run).
        Returns:
            The kernel, or None for SDPA's own choice.
        """
        with self.lock:
            choice = self.choices.get(key, _UNKNOWN)
            if choice is not _UNKNOWN:
                return choice
            self.measuring = threading.get_ident()
            try:
                return self._first_use(key, allowed, check, measure, label, persist)
            finally:
                self.measuring = None

    def _first_use(self, key: str, allowed: Sequence[str], check: Callable[[str], bool],
                   measure: Callable[[], str | None], label: Callable[[str], str], persist: bool) -> str | None:
        """`resolve` under the lock, once no choice is in memory for `key`."""
        saved = self.file.read().get(key) if persist else None
        if saved is not None and saved in allowed and check(saved):
            return self.remember(key, saved)
        if saved is not None:
            self.note(f"the saved dense kernel {saved!r} for {key} does not run or match here: measuring again")
        choice = measure()
        if choice is None:
            self.note(f"dense attention for {key} runs on SDPA's own choice: no candidate kernel ran and "
                      "matched here; a later process measures again", logging.WARNING)
        elif persist:
            log.info("dense attention for %s runs on %s (measured once, saved in %s)", key, label(choice),
                     self.path)
            self.file.save(key, choice)
        else:
            log.info("dense attention for %s runs on %s (measured in this process)", key, label(choice))
        return self.remember(key, choice)

    def candidates(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, host: HostAttention | None,
                   precision: str) -> tuple[str, ...]:
        """The kernels these inputs may run on in a run of `precision`, in order of preference for equal
        times: SDPA's backends (SDPA's own choice on the CPU), the dense kernels families offer
        (`registry.DENSE_KERNELS`) where they run, then the host's function (unless it is 8-bit in a
        bf16 run: said once). A kernel with a disk cache of what it compiles is pointed at the folder of
        this object's file first (`DenseKernel.disk_cache`): every dense call asks for its candidates
        before it runs any, so this happens before the kernel's package is first imported."""
        names = candidates(q, k, v) if q.is_cuda else (DEFAULT,)
        for dense in DENSE_KERNELS:
            reason = dense.unavailable(q)
            if reason is None:
                names += (dense.name,)
                if dense.disk_cache is not None:  # before the kernel's package is first imported
                    self.note(dense.disk_cache(self.path.parent))
                if dense.first_call:
                    self.note(f"dense kernel {dense.label} is a candidate here: {dense.first_call}")
            elif q.is_cuda and dense.installed():
                self.note(f"dense kernel {dense.label} is not a candidate: it {reason}")
        if host is not None:
            if host.eight_bit and precision != "8-bit":
                self.note(f"dense kernel {host.name()} is not a candidate: it computes in 8-bit and this run's "
                          f"precision is {precision}")
            else:
                names += (HOST,)
        return names

    def ahead(self, key: str, allowed: tuple[str, ...]) -> str | None:
        """The choice `prepare` saved for `key`'s bucket without a host function, where it is among `allowed`."""
        if "|host " not in key:
            return None
        saved = self.file.read().get(key.rsplit("|host ", 1)[0] + "|host none")
        return saved if saved is not None and saved != HOST and saved in allowed else None

    def narrowed(self, key: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
        """The candidates timed for `key`, a bucket with the host's function among `allowed`: where the
        file holds the choice of the same bucket without a host function (`ahead`: measured by `prepare`,
        which has none), only that kernel and the host's function are timed, since the fastest of all is
        the faster of those two; the first dense call then neither compiles nor times the kernels that
        lost there (FlashAttention-4's first call compiles). Else all of `allowed`."""
        saved = self.ahead(key, allowed) if HOST in allowed else None
        if saved is None:
            return allowed
        self.note(f"dense kernels for {key}: {self.label(saved)} was measured fastest ahead for the same shape "
                  "without a host function; only it and the host's function are timed")
        return (saved, HOST)

    def label(self, name: str | None, host: HostAttention | None = None) -> str:
        """How the report names kernel `name` (None: SDPA's own choice)."""
        if name == HOST and host is not None:
            return host.name()
        return LABELS.get(name or DEFAULT, str(name))

    @staticmethod
    def kernel(name: str | None, host: HostAttention | None) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                                                         torch.Tensor]:
        """The function that runs kernel `name` on [B, H, S, D] inputs."""
        if name == HOST:
            return host.run
        offered = next((d for d in DENSE_KERNELS if d.name == name), None)
        if offered is not None:
            return offered.attention
        return lambda q, k, v: sdpa(q, k, v, name)

    @torch.compiler.disable
    def first_use(self, key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, host: HostAttention | None,
                  precision: str) -> str | None:
        """`resolve` on these inputs: candidates checked and timed on the first SAMPLE_ROWS queries
        against a float32 reference, within `tolerance` of the precision (its unit: SDPA's own error
        on the same rows)."""
        allowed = self.candidates(q, k, v, host, precision)
        saved = self.ahead(key, allowed) if host is not None and host.identity in SDPA_HOSTS else None
        if saved is not None:  # ComfyUI's own attention is SDPA: nothing to measure at run time
            self.note(f"dense attention for {key} runs on {self.label(saved)}, measured ahead by `prepare` among "
                      "SDPA's kernels, which ComfyUI's own attention runs (not timed again)")
            with self.lock:
                return self.remember(key, saved)
        sample = q[:, :, :SAMPLE_ROWS]
        timer = self.timer or (lambda fn: median_ms(fn, q.device, reps=REPS))

        def run(name: str) -> torch.Tensor:
            return probe(self.kernel(name, host)(sample, k, v))

        def label(name: str) -> str:
            return self.label(name, host)

        def measure() -> str | None:
            times: dict[str, float] = {}
            choice = fastest(self.narrowed(key, allowed), run, timer, reference, tol, self.note, label, times)
            self.note(f"dense kernels measured for {key} (bound {tol:.1e} relative L2, {precision}): "
                      + ", ".join(f"{label(n)} {t:.3g} ms" for n, t in times.items()))
            return choice

        device = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
        with device, torch.no_grad(), self.paused():
            try:
                reference = reference_attention(sample, k, v)
            except Exception as exc:  # out of memory: no candidate can be checked
                self.note(f"the float32 reference for {key} cannot run here ({describe(exc)})", logging.WARNING)
                reference = None
            tol = tolerance(q.dtype, precision, None if reference is None else exact_error(run, reference, allowed))
            return self.resolve(
                key, allowed,
                lambda name: reference is not None and agrees(name, run, reference, tol, self.note, label),
                lambda: None if reference is None else measure(), label, persist=q.is_cuda)

    def choice(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, host: HostAttention | None = None,
               precision: str = "bf16") -> str | None:
        """The kernel for dense attention of these inputs: measured on first use of a shape bucket.

        Args:
            q, k, v: [B, H, S, D].
            host: the host application's own attention for this call, a candidate too.
            precision: "bf16" or "8-bit": the bound the candidates must meet (`tolerance`).
        Returns:
            The kernel, or None where SDPA's own choice runs (the CPU without a host function, or no
            candidate ran).
        """
        if not q.is_cuda and host is None:
            return None
        key = self.key(q, k, v, host, precision)
        return self.lookup(key, lambda: self.first_use(key, q, k, v, host, precision))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, host: HostAttention | None = None,
                  precision: str = "bf16") -> tuple[torch.Tensor, str | None]:
        """Softmax attention of q, k, v [B, H, S, D] on the fastest kernel for them that meets `precision`.

        Args:
            q, k, v: one dtype and device; scale head_dim ** -0.5, no mask.
            host: the host application's own attention for this call, a candidate too.
            precision: "bf16" or "8-bit".
        Returns:
            ([B, H, S, D] in q's dtype, the kernel that ran: None for SDPA's own choice).
        """
        choice = self.choice(q, k, v, host, precision)
        if choice is None:
            if q.is_cuda and wide_rows(q, k, v):  # SDPA's own pick may be memory-efficient
                q, k, v = (t.contiguous() for t in (q, k, v))
            return sdpa(q, k, v, None), None
        return self.kernel(choice, host)(q, k, v), choice
