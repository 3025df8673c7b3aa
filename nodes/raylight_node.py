"""The "Adaptive Sparse Attention (MiniMax-H3, Raylight)" node: widgets -> SparseConfig -> every Ray worker.

Raylight keeps the model in its Ray workers and passes RAY_ACTORS between its nodes; a patch node
runs its patch on each worker's ModelPatcher through Raylight's ``ray_patch``. This node sends
`nodes.raylight.worker_patch` there.
"""
from __future__ import annotations

from comfy_api.latest import io

from .raylight import worker_patch
from .schema import io_input
from .widgets import (CATEGORY, RAYLIGHT_NODE_ID, RAYLIGHT_NODE_NAME, SPARSE_WIDGETS, check_queued,
                      config_from_widgets, validation_answer)

RayActors = io.Custom("RAY_ACTORS")


class AdaptiveSparseAttentionH3Raylight(io.ComfyNode):
    """Runs MiniMax-H3's DiT blocks with adaptive sparse attention on every Raylight worker."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        """The node's V3 schema (the sparse node's widgets, on Raylight's RAY_ACTORS)."""
        return io.Schema(
            node_id=RAYLIGHT_NODE_ID,
            display_name=RAYLIGHT_NODE_NAME,
            category=CATEGORY,
            description=("Adaptive sparse attention for MiniMax-H3 loaded through Raylight (several GPUs). With "
                         "Ulysses sequence parallelism each GPU runs it on its group of heads, with the same block "
                         "selection as one GPU; ulysses_degree must divide 56 and ring_degree must be 1. Place it "
                         "after Raylight's model loader and before its sampler."),
            inputs=[RayActors.Input("ray_actors", tooltip="Raylight's workers holding a MiniMax-H3 model.")]
            + [io_input(w) for w in SPARSE_WIDGETS],
            outputs=[RayActors.Output(display_name="ray_actors",
                                      tooltip="The same workers, their models running sparse attention.")],
        )

    @classmethod
    def validate_inputs(cls, dense_layers: str | None = None, block_size: int | None = None,
                        topk_ratio: float | None = None, measure_error: bool | None = None,
                        error_target: float | None = None) -> bool | str:
        """Refuse, when the prompt is queued, what the sparse node refuses then (`widgets.check_queued`)."""
        return validation_answer(lambda: check_queued(dense_layers, block_size, topk_ratio, measure_error,
                                                      error_target))

    @classmethod
    def execute(cls, ray_actors, **widgets) -> io.NodeOutput:
        """Send the patch of these widgets' config to every Ray worker (`raylight.worker_patch`)."""
        config = config_from_widgets(widgets)
        try:
            from raylight.comfy_extra_dist.ray_patch_decorator import ray_patch
        except ImportError as err:
            raise RuntimeError(f"{RAYLIGHT_NODE_NAME} needs Raylight (ComfyUI custom node komikndr/raylight) "
                               f"and Ray: {err}") from err
        return io.NodeOutput(ray_patch(worker_patch(config))(None, ray_actors)[0])
