"""Capture files: Q/K/V of chosen (layer, step) calls plus the sequence layout, in safetensors.

A capture holds real activations so the quality metrics (`python -m adaptive_sparse_attention
evaluate FILE`) can run on them offline. Entry i is stored as tensors ``"{i}.q"``, ``"{i}.k"``,
``"{i}.v"`` ([B, H, S, D], saved contiguous on the CPU in their own dtype); the safetensors header
metadata holds JSON: the format version, every entry's layer and step, the layout segments
``[start, stop, kind, grid-or-null]`` and free-form `meta` (model, sigma, resolution, ...).
safetensors is imported on use, so the package itself does not require it.
"""
from __future__ import annotations

import json
from typing import Any

import torch

from ..errors import SparseAttentionError
from ..backend.layout import SequenceLayout

FORMAT = "adaptive-sparse-attention/capture"
VERSION = 1


def layout_to_json(layout: SequenceLayout) -> list[list[Any]]:
    """Segments as JSON-ready lists ``[start, stop, kind, [T, H, W] or None]``."""
    return [[s.start, s.stop, s.kind, list(s.grid) if s.grid else None] for s in layout.segments]


def layout_from_json(raw: list[list[Any]]) -> SequenceLayout:
    """The `SequenceLayout` of segments written by `layout_to_json` (validated again)."""
    return SequenceLayout.from_segments([(int(a), int(b), str(kind), tuple(g) if g else None) for a, b, kind, g in raw])


def save_capture(path: str, entries: list[dict[str, Any]], layout: SequenceLayout, meta: dict[str, Any] | None = None) -> None:
    """Write `entries` ({"layer": int, "step": int, "q", "k", "v": Tensor [B, H, S, D]}) to `path`."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    index = []
    for i, entry in enumerate(entries):
        missing = {"layer", "step", "q", "k", "v"} - set(entry)
        if missing:
            raise SparseAttentionError(f"save_capture: entry {i} lacks {sorted(missing)}; expected layer, step, q, k, v")
        for name in ("q", "k", "v"):
            t = entry[name]
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[2] != layout.total:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise SparseAttentionError(f"save_capture: entry {i} {name} must be [B, H, {layout.total}, D] for the layout, got {shape}")
            tensors[f"{i}.{name}"] = t.detach().to("cpu").contiguous()
        index.append({"layer": int(entry["layer"]), "step": int(entry["step"])})
    header = {"format": FORMAT, "version": str(VERSION), "entries": json.dumps(index),
              "layout": json.dumps(layout_to_json(layout)), "meta": json.dumps(meta or {})}
    save_file(tensors, path, metadata=header)


def capture_header(path: str) -> tuple[list[dict[str, Any]], SequenceLayout, dict[str, Any]]:
    """The index, layout and meta of a capture file, read from its header alone (no tensor is loaded).

    Raises:
        OSError: the file cannot be opened.
        ValueError: it is not a safetensors file, not a capture file, of a newer version, or its header
            is incomplete; the message says which.
    """
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            header, names = f.metadata() or {}, set(f.keys())
    except OSError:
        raise
    except Exception as err:  # safetensors raises its own error type for a file that is not one
        raise SparseAttentionError(f"{path} is not a safetensors file ({' '.join(str(err).split())})") from None
    if header.get("format") != FORMAT:
        raise SparseAttentionError(f"{path} is not a capture file (format {header.get('format')!r}, expected {FORMAT!r})")
    if int(header.get("version", 0)) > VERSION:
        raise SparseAttentionError(f"{path} has capture version {header['version']}; this pack reads up to {VERSION} "
                         "(update the pack)")
    try:
        index = json.loads(header["entries"])
        layout = layout_from_json(json.loads(header["layout"]))
        meta = json.loads(header.get("meta", "{}"))
    except (KeyError, TypeError, ValueError) as err:
        raise SparseAttentionError(f"{path} has an incomplete capture header ({type(err).__name__}: {err})") from None
    missing = [f"{i}.{n}" for i in range(len(index)) for n in ("q", "k", "v") if f"{i}.{n}" not in names]
    if missing:
        raise SparseAttentionError(f"{path} lacks the tensors {', '.join(missing[:6])}: the file is incomplete")
    return index, layout, meta


def load_capture(path: str, device: torch.device | str = "cpu"
                 ) -> tuple[list[dict[str, Any]], SequenceLayout, dict[str, Any]]:
    """Read a file written by `save_capture`: (entries, layout, meta); errors as `capture_header`."""
    from safetensors import safe_open

    index, layout, meta = capture_header(path)
    with safe_open(path, framework="pt", device=str(device)) as f:
        entries = [{"layer": e["layer"], "step": e["step"], **{n: f.get_tensor(f"{i}.{n}") for n in ("q", "k", "v")}}
                   for i, e in enumerate(index)]
    return entries, layout, meta
