"""SparseConfig: defaults mirror the node, every bad value names field, value and what is allowed,
and every widget of the node shows exactly its field's declared default, bounds or choices."""
import pytest

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.backend.config import settings
from adaptive_sparse_attention.backend.rules import Choice, Flag, Integer, LayerIndices, Number
from adaptive_sparse_attention.nodes.widgets import SPARSE_WIDGETS
from adaptive_sparse_attention.backend.index_lists import parse_layer_list


def test_defaults_match_the_node():
    cfg = SparseConfig()
    assert (cfg.topk_ratio, cfg.warmup_mode, cfg.sparse_scope, cfg.tail_granularity) == (0.2, "fidelity", "target-video", "query")
    assert (cfg.tiling, cfg.reblock_layout, cfg.tail, cfg.block_size, cfg.kernel) == ("reblock", "q_reuse_k", "reweight", 64, "auto")
    assert cfg.plan_reuse == "auto"


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
    ("kernel", "cuda", "'auto', 'cudnn', 'sm90', 'triton', 'torch'"),
    ("dense_layers", (0, -2), "non-negative layer indices"),
    ("plan_reuse", "yes", "'off', 'on', 'auto'"),
])
def test_bad_values_name_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as err:
        SparseConfig(**{field: value})
    message = str(err.value)
    assert f"SparseConfig.{field}={value!r}" in message
    assert allowed in message


def test_dense_layers_from_widget_string():
    assert parse_layer_list("3, 0,1, 5-7,1", "SparseConfig.dense_layers") == (0, 1, 3, 5, 6, 7)
    assert SparseConfig(dense_layers="0,2").dense_layers == (0, 2)
    for bad in ("a", "3-1", "-1"):
        with pytest.raises(ValueError, match="dense_layers"):
            parse_layer_list(bad, "SparseConfig.dense_layers")


def test_replace_validates_and_rejects_unknown_fields():
    cfg = SparseConfig().replace(topk_ratio=0.1, tail="mean")
    assert (cfg.topk_ratio, cfg.tail) == (0.1, "mean")
    with pytest.raises(ValueError, match="topk_ratio"):
        cfg.replace(topk_ratio=2)
    with pytest.raises(ValueError, match="no field"):
        cfg.replace(ratio=0.1)


@pytest.mark.parametrize("make", [lambda: SparseConfig(backend="triton"), lambda: SparseConfig().replace(backend="triton")],
                         ids=["constructor", "replace"])
def test_the_old_field_name_backend_says_what_it_became(make):
    """`backend` (the kernel family's old name) is refused with the new name, the value and what is allowed,
    not a bare TypeError; it is no field, so settings(), the widgets and saved workflows do not see it."""
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value) == ("SparseConfig.backend='triton': the field is now called kernel "
                              "(SparseConfig(kernel='triton')); allowed: 'auto', 'cudnn', 'sm90', 'triton', 'torch'")
    assert "backend" not in settings()
    assert SparseConfig(kernel="triton").kernel == "triton"


WIDGETS = {w.name: w for w in SPARSE_WIDGETS}


@pytest.mark.parametrize("name", list(settings()))
def test_every_widget_shows_its_fields_declaration(name):
    declared = settings()[name]
    w, rule = WIDGETS[name], declared.rule
    assert w.tooltip == declared.meaning
    assert w.tooltip
    if isinstance(rule, LayerIndices):
        assert (w.kind, w.default) == ("string", ",".join(map(str, declared.default)))
    else:
        assert w.default == declared.default
        assert type(w.default) is type(declared.default)
    if isinstance(rule, (Number, Integer)):
        assert (w.kind, w.min, w.max) == ("float" if isinstance(rule, Number) else "int", rule.lo, rule.hi)
    elif isinstance(rule, Choice) and isinstance(rule.choices[0], int):  # an int widget whose steps walk the choices
        assert w.kind == "int"
        assert tuple(range(int(w.min), int(w.max) + 1, int(w.step))) == rule.choices
    elif isinstance(rule, Choice):
        assert (w.kind, w.options) == ("combo", rule.choices)
    elif not isinstance(rule, LayerIndices):
        assert isinstance(rule, Flag)
        assert w.kind == "boolean"


def accepted(name, value):
    try:
        SparseConfig(**{name: value})
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("w", [w for w in SPARSE_WIDGETS if w.kind != "string"], ids=lambda w: w.name)
def test_a_widget_accepts_exactly_what_its_field_accepts(w):
    """At the bounds, one step beyond them, between them, and on every option and a non-option."""
    if w.kind == "combo":
        values = [*w.options, "not-" + w.options[0]]
    elif w.kind == "boolean":
        values = [True, False]
    else:
        step = w.step
        values = [w.min, w.max, w.min - step, w.max + step, w.min + step * ((w.max - w.min) // (2 * step))]
        values = [int(v) if w.kind == "int" else v for v in values]
    for value in values:
        assert w.accepts(value) == accepted(w.name, value), (w.name, value)
