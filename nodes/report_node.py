"""The "Sparse Attention Report" node: shows in the graph what the last sampling run did.

A MODEL-patch node runs before sampling, so the report sits after the sampler: it takes the
sampler's LATENT (which orders it after the run) and the patched MODEL (whose sparse hook keeps
the last run's report), passes the latent through, and shows the text on the node (UI output,
kept in /history) and as the node's progress text.
"""
from __future__ import annotations

from comfy_api.latest import io, ui

from .model_patches import hooks_of
from .sparse_policy import SparseAttentionHook
from .report import format_report
from .widgets import CATEGORY, REPORT_NODE_ID, REPORT_NODE_NAME, REPORT_SEARCH_ALIASES, SPARSE_NODE_NAME


def report_text(model) -> str:
    """The report of every sparse hook on `model` (normally one)."""
    hooks = [h for h in hooks_of(model) if isinstance(h, SparseAttentionHook)]
    if not hooks:
        return (f"This MODEL has no {SPARSE_NODE_NAME} node: connect the model that node outputs "
                "(the one the sampler uses).")
    return "\n\n".join("\n".join([format_report(h.tracker.last_report)] + [f"Note: {n}" for n in h.notices])
                       for h in hooks)


class SparseAttentionReport(io.ComfyNode):
    """Shows which steps and blocks ran sparse, the density, the time, and why blocks ran dense."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        """The node's V3 schema: the sampler's latent and the patched model in, the latent out."""
        return io.Schema(
            node_id=REPORT_NODE_ID,
            display_name=REPORT_NODE_NAME,
            category=CATEGORY,
            search_aliases=list(REPORT_SEARCH_ALIASES),
            description=("Place after the sampler: shows what adaptive sparse attention did in the last run "
                         "(sparse steps and blocks, mean density, attention time, the attention time saved against the "
                         "dense attention these blocks would have run, and why blocks ran dense). The latent passes "
                         "through unchanged."),
            inputs=[io.Latent.Input("samples", tooltip="The sampler's output (orders this node after the run)."),
                    io.Model.Input("model", tooltip=f"The MODEL output of {SPARSE_NODE_NAME} that the sampler used.")],
            outputs=[io.Latent.Output(tooltip="The same latent.")],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, samples, model) -> io.NodeOutput:
        """Pass the latent through and show the report text on the node."""
        text = report_text(model)
        from server import PromptServer

        server, node_id = getattr(PromptServer, "instance", None), getattr(cls.hidden, "unique_id", None)
        if server is not None and node_id is not None:  # a server run (not a direct call): text on the node
            server.send_progress_text(text, node_id, getattr(server, "client_id", None))  # the queuing client
        return io.NodeOutput(samples, ui=ui.PreviewText(text))
