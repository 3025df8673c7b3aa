"""SparseConfig: defaults mirror the node, every bad value names field, value and what is allowed."""
import pytest

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.backend.config import parse_layer_list


def test_defaults_match_the_node():
    cfg = SparseConfig()
    assert (cfg.topk_ratio, cfg.warmup_mode, cfg.sparse_scope, cfg.tail_granularity) == (0.2, "fidelity", "target-video", "query")
    assert (cfg.tiling, cfg.reblock_layout, cfg.tail, cfg.block_size, cfg.backend) == ("reblock", "q_reuse_k", "reweight", 64, "auto")


@pytest.mark.parametrize("field,value,allowed", [
    ("topk_ratio", 0.0, "[0.01, 1.0]"),
    ("topk_ratio", 1.5, "[0.01, 1.0]"),
    ("topk_ratio", "0.1", "[0.01, 1.0]"),
    ("warmup_ratio", -0.1, "[0.0, 1.0]"),
    ("warmup_mode", "fast", "'fidelity', 'speed', 'dense'"),
    ("sparse_scope", "video", "'target-video', 'joint-video'"),
    ("tail_granularity", "token", "'query', 'block'"),
    ("tiling", "hilbert", "'reblock', 'cube'"),
    ("reblock_layout", "shared", "'q_reuse_k', 'independent'"),
    ("tail", "sum", "'reweight', 'mean', 'none', 'coarse'"),
    ("block_size", 96, "one of 64, 128"),
    ("min_tokens", -1, "an integer in [0, 4194304]"),
    ("strict", "yes", "True or False"),
    ("backend", "cuda", "'auto', 'cudnn', 'triton', 'torch'"),
    ("dense_layers", (0, -2), "non-negative layer indices"),
])
def test_bad_values_name_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as err:
        SparseConfig(**{field: value})
    message = str(err.value)
    assert f"SparseConfig.{field}={value!r}" in message and allowed in message


def test_dense_layers_from_widget_string():
    assert parse_layer_list("3, 0,1, 5-7,1") == (0, 1, 3, 5, 6, 7)
    assert SparseConfig(dense_layers="0,2").dense_layers == (0, 2)
    for bad in ("a", "3-1", "-1"):
        with pytest.raises(ValueError, match="dense_layers"):
            parse_layer_list(bad)


def test_replace_validates_and_rejects_unknown_fields():
    cfg = SparseConfig().replace(topk_ratio=0.1, tail="mean")
    assert (cfg.topk_ratio, cfg.tail) == (0.1, "mean")
    with pytest.raises(ValueError, match="topk_ratio"):
        cfg.replace(topk_ratio=2)
    with pytest.raises(ValueError, match="no field"):
        cfg.replace(ratio=0.1)
