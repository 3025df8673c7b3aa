"""FlashAttention-4's disk cache of compiled kernels: the dense choice points it at a folder the pack owns (beside
its choice file) before FlashAttention-4 is first imported, without overriding the user's own setting. A stand-in
`flash_attn.cute` package on a temporary path records the environment when it is imported."""
from __future__ import annotations

import dataclasses
import os
import sys
import textwrap

import pytest
import torch

from adaptive_sparse_attention.kernels.dense import choice as dense
from adaptive_sparse_attention.kernels.flash4 import attention as flash4
from adaptive_sparse_attention.kernels.flash4.family import FLASH4

STANDIN = '''
import os

import torch

SEEN = {name: os.environ.get(name) for name in ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
                                                "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")}


def flash_attn_func(q, k, v):  # [B, S, H, D]
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2), None
'''


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """A stand-in FlashAttention-4 (with `cache_utils.py`, as flash-attn-4 4.0.0b36 has) importable from a
    temporary folder; the cache variables unset (restored after), no `flash_attn` module imported."""
    package = tmp_path / "site" / "flash_attn" / "cute"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text(textwrap.dedent(STANDIN))
    (package / "cache_utils.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in (flash4.CACHE_ENABLED, flash4.CACHE_DIR):
        monkeypatch.delenv(name, raising=False)
    yield package
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]


def first_dense_call(folder, monkeypatch) -> list[str]:
    """The dense choice's first call on the CPU with FlashAttention-4 a candidate (the stand-in, as it would run
    on an sm90 GPU) and a host function, so the candidates are measured; the messages it says."""
    monkeypatch.setattr(dense, "DENSE_KERNELS", (dataclasses.replace(FLASH4, unavailable=lambda q: None),))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 200, 32, generator=g) for _ in range(3))
    choices = dense.DenseChoices(folder / "dense_choices.json", timer=lambda fn: (fn(), 1.0)[1])
    seen = []
    choices.note = lambda message, level=None: seen.append(message)
    host = dense.HostAttention("tests.host", lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    choices.attention(q, k, v, host)
    return seen


def test_the_cache_folder_is_set_before_flashattention4_is_imported(standin, tmp_path, monkeypatch):
    """FlashAttention-4 ran (it was measured) and saw, at its import, its cache on and in the pack's folder."""
    folder = tmp_path / "user" / "adaptive_sparse_attention"
    seen = first_dense_call(folder, monkeypatch)
    cute = sys.modules["flash_attn.cute"]
    assert cute.SEEN == {flash4.CACHE_ENABLED: "1", flash4.CACHE_DIR: str(folder / flash4.CACHE_FOLDER)}
    assert f"FlashAttention-4 keeps its compiled kernels in {folder / flash4.CACHE_FOLDER}" in seen[0]
    assert any("dense kernels measured" in m and "FlashAttention-4" in m for m in seen)


def test_the_users_own_setting_is_left_as_it_is(standin, tmp_path, monkeypatch):
    monkeypatch.setenv(flash4.CACHE_DIR, str(tmp_path / "mine"))
    seen = first_dense_call(tmp_path / "pack", monkeypatch)
    assert sys.modules["flash_attn.cute"].SEEN == {flash4.CACHE_ENABLED: None, flash4.CACHE_DIR: str(tmp_path / "mine")}
    assert "as the environment says" in seen[0]


def test_without_a_disk_cache_nothing_is_set_and_it_is_said(standin, tmp_path, monkeypatch):
    """An older FlashAttention-4 (no cache_utils.py): its first call compiles in every process, as the line says."""
    (standin / "cache_utils.py").unlink()
    seen = first_dense_call(tmp_path / "pack", monkeypatch)
    assert sys.modules["flash_attn.cute"].SEEN == {flash4.CACHE_ENABLED: None, flash4.CACHE_DIR: None}
    assert "has no disk cache" in seen[0]


def test_imported_before_the_pack_nothing_is_set(standin, tmp_path, monkeypatch):
    """Another package imported FlashAttention-4 (and its cache) first: the variables would not be read any more."""
    import flash_attn.cute  # noqa: F401
    monkeypatch.setitem(sys.modules, "flash_attn.cute.cache_utils", sys.modules["flash_attn.cute"])
    line = flash4.disk_cache(tmp_path / "pack")
    assert "was imported before this pack" in line
    assert flash4.CACHE_ENABLED not in os.environ
