"""The "Adaptive Sparse Attention (MiniMax-H3)" node: widgets -> SparseConfig -> patched MODEL."""
from __future__ import annotations

from comfy_api.latest import io

from .sparse_policy import apply_sparse_attention
from .h3_model import h3_diffusion_model
from .schema import io_input
from .widgets import (CATEGORY, SPARSE_NODE_ID, SPARSE_NODE_NAME, SPARSE_SEARCH_ALIASES, SPARSE_WIDGETS,
                      check_dense_layers, check_queued, config_from_widgets, model_layer_count,
                      validation_answer)


class AdaptiveSparseAttentionH3(io.ComfyNode):
    """Runs every MiniMax-H3 DiT block with adaptive block-sparse attention."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        """The node's V3 schema (widgets from `widgets.SPARSE_WIDGETS`)."""
        return io.Schema(
            node_id=SPARSE_NODE_ID,
            display_name=SPARSE_NODE_NAME,
            category=CATEGORY,
            search_aliases=list(SPARSE_SEARCH_ALIASES),
            description=("Replaces dense attention in MiniMax-H3's DiT blocks with adaptive block-sparse attention: "
                         "exact attention on the key blocks that matter for each query block, summaries for the "
                         "rest, text and audio kept exact. Place it between the model loader (and any LoRA or "
                         "low-VRAM nodes) and the sampler."),
            inputs=[io.Model.Input("model", tooltip="A MiniMax-H3 model.")] + [io_input(w) for w in SPARSE_WIDGETS],
            outputs=[io.Model.Output(tooltip="The model with sparse attention in its DiT blocks.")],
        )

    @classmethod
    def validate_inputs(cls, dense_layers: str | None = None, block_size: int | None = None,
                        topk_ratio: float | None = None, measure_error: bool | None = None,
                        error_target: float | None = None) -> bool | str:
        """Refuse, when the prompt is queued, a malformed dense_layers or one beyond any model (the
        model's own block count is known only when the node runs: `execute` says it in the same
        words), a block_size that is not an allowed value (ComfyUI checks the ranges and choices
        of the other widgets) and an error_target with measure_error off or a topk_ratio outside its
        range (`widgets.check_queued`). A value linked from another node is None here and is checked in
        `execute`."""
        return validation_answer(lambda: check_queued(dense_layers, block_size, topk_ratio, measure_error,
                                                      error_target))

    @classmethod
    def execute(cls, model, **widgets) -> io.NodeOutput:
        """A clone of `model` whose H3 blocks run sparse attention under the widgets' config (the
        model checked first, then the dense layers against its block count); an optional widget a
        prompt leaves out takes its default."""
        h3_diffusion_model(model, SPARSE_NODE_NAME)
        if "dense_layers" in widgets:
            check_dense_layers(widgets["dense_layers"], model_layer_count(model))
        return io.NodeOutput(apply_sparse_attention(model, config_from_widgets(widgets)))
