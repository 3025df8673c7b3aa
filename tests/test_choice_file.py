"""The file of saved dense-kernel choices: whatever is at its path is read safely, and writes from
several processes at once lose nothing and leave no temporary file behind."""
from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import threading

import pytest

from adaptive_sparse_attention.kernels.dense import store as choice_file
from adaptive_sparse_attention.kernels.dense.store import ChoiceFile


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def read_twice_and_save(path, caplog) -> dict:
    """Read, read again and save one entry; returns what the first read gave."""
    f = ChoiceFile(path)
    with caplog.at_level("WARNING", logger="adaptive_sparse_attention"):
        first = f.read()
        assert f.read() == first
        f.save("k", "flash")
    return first


@pytest.mark.parametrize("text,why", [
    ("{not json", "malformed"),
    ("[" * 100000 + "]" * 100000, "malformed"),
    ('{"k": ' + '{"k": ' * 30000 + '"flash"' + "}" * 30001, "malformed"),
    ('{"k": ["flash"]}', "malformed"),
    ('{"k": null}', "malformed"),
    ('"flash"', "malformed"),
    (b"\xff\xfe{}", "cannot be read"),
    ("{" + " " * choice_file.MAX_BYTES + "}", "cannot be read"),
])
def test_a_damaged_file_is_ignored_with_one_warning_and_rewritten(text, why, tmp_path, caplog):
    path = tmp_path / "choices.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert read_twice_and_save(path, caplog) == {}
    warned = warnings_of(caplog)
    assert len(warned) == 1, warned
    assert why in warned[0], warned
    assert json.loads(path.read_text()) == {"k": "flash"}


def test_strings_may_hold_brackets_and_escapes(tmp_path, caplog):
    path = tmp_path / "choices.json"
    entries = {'GPU [x] {y} "z" \\': "flash", "other": "[cudnn]"}
    path.write_text(json.dumps(entries))
    assert read_twice_and_save(path, caplog) == entries
    assert not warnings_of(caplog)
    assert json.loads(path.read_text()) == {**entries, "k": "flash"}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_at_the_path_is_never_opened(tmp_path, caplog):
    path = tmp_path / "choices.json"
    os.mkfifo(path)
    result = []
    worker = threading.Thread(target=lambda: result.append(read_twice_and_save(path, caplog)), daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "reading a FIFO blocked"
    assert result == [{}]
    warned = warnings_of(caplog)
    assert len(warned) == 1
    assert "not a regular file" in warned[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["choices.json"]  # still the FIFO; nothing written


def test_a_directory_at_the_path_is_warned_about_once(tmp_path, caplog):
    assert read_twice_and_save(tmp_path, caplog) == {}
    warned = warnings_of(caplog)
    assert len(warned) == 1
    assert "is a directory" in warned[0]
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_folder_is_warned_about_once_and_read(tmp_path, caplog, monkeypatch):
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "choices.json").write_text('{"old": "cudnn"}')
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):  # root ignores the mode: refuse writes as the file system would
            def refuse(*args, **kwargs):
                raise PermissionError(13, "Permission denied")
            monkeypatch.setattr(tempfile, "mkstemp", refuse)
        f = ChoiceFile(folder / "choices.json")
        with caplog.at_level("WARNING", logger="adaptive_sparse_attention"):
            f.save("k1", "flash")
            f.save("k2", "flash")
            assert f.read() == {"old": "cudnn"}
        warned = warnings_of(caplog)
        assert len(warned) == 1, warned
        assert "cannot be written" in warned[0], warned
        assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    finally:
        folder.chmod(0o755)


def test_a_failed_replace_leaves_no_temporary_file(tmp_path, caplog, monkeypatch):
    path = tmp_path / "choices.json"
    f = ChoiceFile(path)
    f.save("a", "cudnn")

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with caplog.at_level("WARNING", logger="adaptive_sparse_attention"):
        f.save("b", "flash")
    assert len(warnings_of(caplog)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["choices.json", "choices.json.lock"]
    assert json.loads(path.read_text()) == {"a": "cudnn"}


def test_the_file_keeps_the_newest_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(choice_file, "MAX_ENTRIES", 3)
    f = ChoiceFile(tmp_path / "choices.json")
    for key in ("a", "b", "c", "a", "d"):
        f.save(key, "flash")
    assert list(f.read()) == ["c", "a", "d"]


def save_keys(path: str, worker: int, count: int) -> None:
    """One process's saves (module level, so a spawned process can run it)."""
    f = ChoiceFile(path)
    for i in range(count):
        f.save(f"worker {worker} key {i}", "flash" if i % 2 else "cudnn")


def test_processes_saving_at_once_lose_no_entry(tmp_path):
    path = tmp_path / "choices.json"
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    workers = [ctx.Process(target=save_keys, args=(str(path), w, 15)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in workers)
    saved = ChoiceFile(path).read()
    assert saved == {f"worker {w} key {i}": "flash" if i % 2 else "cudnn" for w in range(4) for i in range(15)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["choices.json", "choices.json.lock"]
