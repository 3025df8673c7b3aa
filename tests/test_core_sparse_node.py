"""Our node and ComfyUI's core "Model Sparse Attention" node on one model, in both orders (real ComfyUI, CPU).

Both nodes swap the attention of the same blocks; the core node either replaces every H3 block
patch without calling the one it replaced (older ComfyUI) or chains it while overriding the
attention of the calls it leaves (newer). Our node refuses the combination with a message naming
both, at patch time when the core node came first and when sampling starts when it came after.
Uses the real core node when the checkout has it, else both forms of `core_sparse_standin`.
"""
from __future__ import annotations

import pytest

from comfyui_harness import CKPT, comfy, core_sparse_node, needs_comfyui, sample, sparse  # noqa: F401 (fixture)

pytestmark = needs_comfyui
MESSAGE = r"Model Sparse Attention.*applied {} this node.*Keep one of the two nodes"


@pytest.fixture(scope="module", params=["real-or-replaces", "chains"])
def core_node(comfy, request):  # noqa: F811
    """apply(model) of the core node: the real one when ComfyUI has it, else a stand-in form."""
    form = "chains" if request.param == "chains" else "replaces"
    with core_sparse_node(form, {"selection": "sol-attn", "tau": 1.3}) as apply:
        if apply is None:
            pytest.skip("this ComfyUI has the real core node (tested in the other parametrization)")
        yield apply


def test_core_node_first_then_ours_stops_at_patch_time(comfy, core_node):  # noqa: F811
    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    with pytest.raises(ValueError, match=MESSAGE.format("before")):
        sparse(core_node(model))


def test_ours_first_then_core_node_stops_when_sampling_starts(comfy, core_node):  # noqa: F811
    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(CKPT, "default")[0]
    ours = sparse(model)
    both = core_node(ours)
    from adaptive_sparse_attention.nodes.core_sparse import core_sparse_blocks, double_block_patches

    # every block patch is the core node's now (which may or may not call ours)
    assert len(double_block_patches(ours.model_options)) == 2
    assert core_sparse_blocks(both.model_options) == [0, 1]
    with pytest.raises(ValueError, match=MESSAGE.format("after")):
        sample(nodes, both, steps=2)
    sample(nodes, ours, steps=2)  # our node alone still samples afterwards
