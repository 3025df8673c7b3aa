"""`ChoiceFile`: a small JSON map of str -> str that several processes read and extend safely; `Remembered`:
the bounded in-memory side of a choice object.

The measured dense- and sparse-kernel choices outlive a process in such files. Whatever is at the path is
untrusted: a file that is not a regular file (a FIFO, a directory, a device), too large, not JSON,
nested, or not a flat map of strings is ignored with one warning, and a FIFO is never opened
(opening one for reading blocks until a writer appears). Writes merge with what other processes
saved meanwhile, under an exclusive lock on a sidecar file, and replace the file atomically from a
temporary file in the same folder, which is removed whatever happens. A location that cannot be
written is warned about once; the choices then stay in memory.
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, TypeVar

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
try:
    import msvcrt
except ImportError:  # POSIX
    msvcrt = None

from ...errors import SparseAttentionError
from ...notices import logger

log = logger()

MAX_BYTES = 256 * 1024  # a few hundred entries of about 150 bytes; anything larger is not ours
MAX_ENTRIES = 512  # the oldest entries beyond this are dropped when saving
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
MAX_CHOICES = 64  # shape classes a choice object keeps in memory; a model uses a handful
T = TypeVar("T")


def choice_path(env: str, user_dir: str | os.PathLike | None, user_name: str, cache_name: str) -> Path:
    """Where a choice file lives: the environment variable `env` if set, else `user_name` in the pack's
    folder of `user_dir` (ComfyUI's user directory), else `cache_name` in the pack's folder of the user's
    cache folder (``XDG_CACHE_HOME`` or ``~/.cache``)."""
    if os.environ.get(env):
        return Path(os.environ[env])
    if user_dir is not None:
        return Path(user_dir) / "adaptive_sparse_attention" / user_name
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaptive_sparse_attention" / cache_name


def flat_strings(text: str) -> dict[str, str]:
    """The JSON object `text` if it is one flat map of strings to strings.

    Brackets outside string literals are counted before parsing, so nesting of any depth is
    refused without the parser recursing into it.

    Raises:
        ValueError: naming what is wrong with `text`.
    """
    skeleton = JSON_STRING.sub('""', text)
    if skeleton.count("{") != 1 or "[" in skeleton:
        raise SparseAttentionError("not one flat JSON object (nested, or no object)")
    try:
        data = json.loads(text)
    except RecursionError as err:
        raise SparseAttentionError("nested too deeply") from err
    if not isinstance(data, dict):
        raise SparseAttentionError(f"a JSON {type(data).__name__}, not an object")
    bad = next((k for k, v in data.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise SparseAttentionError(f"the entry {bad[:80]!r} is {json.dumps(data[bad])[:20]}, not a string")
    return data


class Remembered:
    """Choices kept in memory by key (`self.choices`), at most MAX_CHOICES, the oldest dropped first."""

    choices: dict

    def remember(self, key: str, choice: T) -> T:
        """Keep `choice` under `key`, dropping the oldest beyond MAX_CHOICES; returns it."""
        self.choices[key] = choice
        while len(self.choices) > MAX_CHOICES:
            del self.choices[next(iter(self.choices))]
        return choice


class ChoiceFile:
    """The JSON file at `path`, read and extended by `read` and `save`.

    Nothing touches the disk before the first `read` or `save`. Each kind of problem (reading,
    writing) is warned about once per object.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.writable = True
        self.warned: set[str] = set()

    def warn(self, kind: str, message: str) -> None:
        """Log `message` as a warning the first time a problem of this `kind` occurs, else at debug level."""
        level = logging.DEBUG if kind in self.warned else logging.WARNING
        self.warned.add(kind)
        log.log(level, "kernel choice file %s: %s", self.path, message)

    def unusable(self) -> str | None:
        """Why the path cannot hold the file (a folder, a device, a FIFO), or None."""
        if not self.path.name:
            return "is not a file path (it names no file)"
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            return None
        except OSError as err:
            return f"cannot be inspected ({err})"
        if stat.S_ISDIR(mode):
            return "is a directory, not a file"
        if not stat.S_ISREG(mode):
            return "is not a regular file (a FIFO, socket or device)"
        return None

    def read(self) -> dict[str, str]:
        """The entries saved so far; {} (after one warning) when the file is absent or unusable.

        Returns:
            The flat map read from the file.
        """
        problem = self.unusable()
        if problem is not None:
            self.writable = False
            self.warn("read", f"{problem}; the choices are kept in memory only")
            return {}
        try:
            text = self.read_text()
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            self.warn("read", f"cannot be read ({err}); it is ignored")
            return {}
        try:
            return flat_strings(text)
        except ValueError as err:
            self.warn("read", f"is malformed ({err}); it is ignored and rewritten on the next save")
            return {}

    def read_text(self) -> str:
        """The file's text, opened without blocking and checked to be a regular file of at most MAX_BYTES."""
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):  # replaced by something else since `unusable` looked
                raise SparseAttentionError("not a regular file")
            if info.st_size > MAX_BYTES:
                raise SparseAttentionError(f"{info.st_size} bytes, more than the {MAX_BYTES} allowed")
            data = os.read(fd, MAX_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > MAX_BYTES:
            raise SparseAttentionError(f"more than the {MAX_BYTES} bytes allowed")
        return data.decode("utf-8")

    def save(self, key: str, value: str) -> None:
        """Add or replace one entry, keeping every entry other processes saved meanwhile.

        A failure is warned about once; the object then stops writing.
        """
        if not self.writable:
            return
        problem = self.unusable()
        if problem is not None:
            self.writable = False
            self.warn("write", f"{problem}; the choices are kept in memory only")
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.exclusive():
                data = self.read()
                if not self.writable:  # replaced by a non-file since `unusable` looked
                    return
                data.pop(key, None)
                data[key] = value
                kept = dict(list(data.items())[-MAX_ENTRIES:])
                self.replace(json.dumps(kept, indent=1))
        except OSError as err:
            self.writable = False
            self.warn("write", f"cannot be written ({err}); the choices are kept in memory only")

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the exclusive lock of the sidecar file ``<name>.lock`` (POSIX flock, Windows msvcrt).

        Without either, the merge in `save` still re-reads the file right before replacing it."""
        fd = os.open(self.path.with_name(self.path.name + ".lock"),
                     os.O_RDWR | os.O_CREAT | getattr(os, "O_NONBLOCK", 0), 0o666)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            elif msvcrt is not None:
                msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
                try:
                    yield
                finally:
                    msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
            else:
                yield
        finally:
            os.close(fd)  # also releases the flock

    def replace(self, text: str) -> None:
        """Write `text` to a temporary file next to the path and move it over the path."""
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
