"""pyproject.toml lists every package of the pack, so a non-editable install (the Comfy Registry's, pip's)
has each folder the code imports (kernels.flash4 and kernels.sparse_choice were once missing)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is in the standard library from Python 3.11")
def test_every_package_folder_is_listed():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("adaptive_sparse_attention",) + p.parent.relative_to(ROOT).parts)
             for p in ROOT.rglob("__init__.py")
             if not any(part.startswith(".") or part in ("tests", "build", "docs", "tools")
                        for part in p.relative_to(ROOT).parts)}
    assert found - listed == set(), f"package folders missing from pyproject.toml: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"
