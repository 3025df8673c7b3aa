"""Progress text on the node ComfyUI is executing (the sampler), for waits the user should see coming."""
from __future__ import annotations

from ..notices import logger

log = logger()


def progress_text(message: str) -> None:
    """Show `message` under the node now executing in ComfyUI's UI (nothing outside a ComfyUI run).

    The console gets the same message from the caller; a UI that cannot be reached costs a debug
    line, never the run.
    """
    try:
        from comfy_execution.utils import get_executing_context
        from server import PromptServer
    except ImportError:
        return
    context, server = get_executing_context(), getattr(PromptServer, "instance", None)
    if context is None or server is None:
        return
    try:
        server.send_progress_text(message, context.node_id)
    except Exception as err:  # the UI channel must never break sampling
        log.debug("adaptive sparse attention: progress text not sent (%s)", err)
