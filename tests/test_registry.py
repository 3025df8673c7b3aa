"""Comfy Registry metadata (pyproject.toml) and node discovery (search aliases).

Without ComfyUI: the fields exist and are well formed. With COMFYUI_PATH: ComfyUI's own parser
(`comfy_config.config_parser`, the code the Registry and ComfyUI-Manager share) reads the same
values back, so a classifier it would drop or a version range it cannot read fails here.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from comfyui_harness import COMFYUI, needs_comfyui
from adaptive_sparse_attention.nodes.widgets import CAPTURE_SEARCH_ALIASES, SPARSE_SEARCH_ALIASES

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
VERSION_RANGE = re.compile(r"^(>=|==|~=|>)\s*\d+\.\d+\.\d+(,\s*(<|<=)\s*\d+\.\d+\.\d+)?$")


def test_pyproject_has_the_registry_fields():
    project, comfy = PYPROJECT["project"], PYPROJECT["tool"]["comfy"]
    assert re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", project["name"])
    assert "comfyui" not in project["name"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    from adaptive_sparse_attention import __version__
    assert project["version"] == __version__  # the cache keys carry the package's version
    assert project["license"] == "GPL-3.0-only"
    assert all((REPO / f).is_file() for f in project["license-files"])
    assert comfy["PublisherId"]
    assert comfy["DisplayName"]
    assert "workflows" in comfy["includes"]
    assert VERSION_RANGE.match(comfy["requires-comfyui"]), comfy["requires-comfyui"]
    assert "Environment :: GPU :: NVIDIA CUDA" in project["classifiers"]


def test_search_aliases_name_the_methods_users_look_for():
    assert {"sparse attention", "sol", "vsa", "spark"} <= set(SPARSE_SEARCH_ALIASES)
    for aliases in (SPARSE_SEARCH_ALIASES, CAPTURE_SEARCH_ALIASES):
        assert len(set(aliases)) == len(aliases)
        assert all(a == a.strip().lower() and a for a in aliases)


@needs_comfyui
def test_comfyui_parser_reads_the_metadata():
    sys.path.insert(0, COMFYUI)
    from comfy_config.config_parser import extract_node_configuration
    from comfyui_version import __version__ as comfyui_version
    from packaging.specifiers import SpecifierSet

    config = extract_node_configuration(str(REPO))
    assert config.project.supported_os == ["POSIX :: Linux", "Microsoft :: Windows"]
    assert config.project.supported_accelerators == ["GPU :: NVIDIA CUDA"]  # any other Environment entry voids it
    assert config.project.license.text == "GPL-3.0-only"
    assert config.tool_comfy.publisher_id == PYPROJECT["tool"]["comfy"]["PublisherId"]
    assert config.tool_comfy.display_name == "Adaptive Sparse Attention (MiniMax-H3)"
    assert config.tool_comfy.includes == ["workflows"]
    assert comfyui_version in SpecifierSet(config.project.supported_comfyui_version)  # the tested release is allowed
