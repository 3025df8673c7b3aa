"""Build V3 `io` inputs from the plain widget data in `widgets.py` (imports ComfyUI's API)."""
from __future__ import annotations

import inspect
from typing import Any

from comfy_api.latest import io

from .widgets import Widget

_KINDS = {"float": io.Float, "int": io.Int, "combo": io.Combo, "string": io.String, "boolean": io.Boolean}
# older ComfyUI has no `advanced` flag on inputs: those widgets then show as normal ones
_HAS_ADVANCED = "advanced" in inspect.signature(io.Float.Input.__init__).parameters


def io_input(widget: Widget) -> Any:
    """The V3 input of one widget."""
    kwargs: dict[str, Any] = {"default": widget.default, "tooltip": widget.tooltip}
    if widget.kind == "combo":
        kwargs["options"] = list(widget.options)
    elif widget.kind in ("float", "int"):
        kwargs.update(min=widget.min, max=widget.max, step=widget.step)
    if widget.advanced and _HAS_ADVANCED:
        kwargs["advanced"] = True
    if widget.optional:
        kwargs["optional"] = True
    return _KINDS[widget.kind].Input(widget.name, **kwargs)
