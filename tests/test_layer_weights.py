"""Q/K/V through the layer's own path, without ComfyUI: which path a Linear takes, and that each one
computes what the layer computes or refuses, naming the class.

Stand-ins: a "ComfyUI" Linear (a class whose module is ComfyUI's), a pack's Linear that stores its
weight in a format of its own and brings its own ``cast_bias_weight`` (as ComfyUI-GGUF's GGMLOps),
a pack's Linear with its own forward (an adapter added in the forward), and layers that cannot be
read. test_comfyui_gguf.py checks the real ComfyUI-GGUF layers.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adaptive_sparse_attention.backend import producer
from adaptive_sparse_attention.nodes.comfy_weights import (ForwardProjection, LayerProjection, qkv_projection,
                                                           weight_path)

H, D, HIDDEN = 3, 8, 16


class ComfyLinear(torch.nn.Linear):
    """Named as one of ComfyUI's op classes: its forward dispatches to ``forward_comfy_cast_weights``
    when the layer casts its weights, as ComfyUI's Linear does."""
    comfy_cast_weights = False
    weight_function: list = []
    bias_function: list = []

    def forward(self, x):
        if self.comfy_cast_weights or self.weight_function or self.bias_function:
            return self.forward_comfy_cast_weights(x)
        return super().forward(x)


ComfyLinear.__module__ = "comfy.ops"


class PackCastLinear(ComfyLinear):
    """A pack's op class (GGUF's pattern): the weight stored as int8 codes with a per-row scale,
    read through its own cast, which ComfyUI's forward reaches through ``forward_comfy_cast_weights``."""
    comfy_cast_weights = True

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        scale = weight.abs().amax(dim=1, keepdim=True) / 127
        self.codes = torch.nn.Parameter(torch.round(weight / scale).to(torch.int8), requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)
        self.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)  # nothing here
        self.casts = 0

    def cast_bias_weight(self, input=None, dtype=None, device=None, bias_dtype=None):
        self.casts += 1
        return self.codes.to(input.dtype) * self.scale.to(input.dtype), None

    def forward_comfy_cast_weights(self, input):
        weight, bias = self.cast_bias_weight(input)
        return F.linear(input, weight, bias)


def pack_forward(self, x):
    return F.linear(x, self.weight) + F.linear(F.linear(x, self.down), self.up)


class PackForwardLinear(torch.nn.Linear):
    """A pack's op class with its own forward: a low-rank adapter added to the plain product."""

    def __init__(self, weight: torch.Tensor, generator: torch.Generator):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.down = torch.randn(2, weight.shape[1], generator=generator, dtype=weight.dtype)
        self.up = torch.randn(weight.shape[0], 2, generator=generator, dtype=weight.dtype)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return pack_forward(self, x)


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(23, HIDDEN, generator=g, dtype=torch.float64)
    w = torch.randn(3 * H * D, HIDDEN, generator=g, dtype=torch.float64) * 0.3
    scale = torch.rand(D, generator=g, dtype=torch.float64) + 0.5
    return x, w, scale, g


def produce(layer, x, scale, heads):
    with qkv_projection(layer, x, H, D) as projection:
        return projection, producer.produce_qkv(x, projection, None, H, D, scale, scale, 1e-6, None, heads,
                                                chunk_rows=10)


def project_rows(out: torch.Tensor, scale: torch.Tensor, heads):
    """The producer's norm and layout applied to projected rows `out` [S, 3*H*D]."""
    identity = producer.WeightProjection(torch.eye(out.shape[1], dtype=out.dtype), None, H, D)
    return producer.produce_qkv(out, identity, None, H, D, scale, scale, 1e-6, None, heads)


def test_which_path_a_linear_takes():
    x, w, _, g = inputs()
    assert weight_path(torch.nn.Linear(4, 4)) == "comfy"
    assert weight_path(ComfyLinear(4, 4)) == "comfy"
    cast = PackCastLinear(w)
    assert weight_path(cast) == "cast"
    cast.weight_function = [lambda weight: weight]  # an on-the-fly LoRA: its own forward decides where it applies
    assert weight_path(cast) == "forward"
    assert weight_path(PackForwardLinear(w, g)) == "forward"


@pytest.mark.parametrize("heads", [(0, H), (1, 3)])
def test_a_pack_cast_is_asked_once_per_call_and_multiplies_as_its_forward(heads):
    x, w, scale, _ = inputs()
    layer = PackCastLinear(w)
    projection, got = produce(layer, x, scale, heads)
    assert isinstance(projection, LayerProjection)
    assert layer.casts == 1  # once per call, for every chunk and head group
    want = project_rows(torch.cat([layer(x[a:a + 10]) for a in range(0, x.shape[0], 10)]), scale, heads)
    assert layer.casts == 4  # the layer's own forward (3 chunks) went through its cast
    for ours, theirs in zip(got, want):
        assert torch.equal(ours, theirs)
    assert not torch.equal(got[0], project_rows(F.linear(x, w), scale, heads)[0])  # the stored format matters


@pytest.mark.parametrize("heads", [(0, H), (1, 3)])
def test_a_pack_forward_runs_on_each_chunk(heads):
    x, w, scale, g = inputs(1)
    layer = PackForwardLinear(w, g)
    projection, got = produce(layer, x, scale, heads)
    assert isinstance(projection, ForwardProjection)
    assert layer.calls == 3  # 23 rows in chunks of 10
    want = project_rows(torch.cat([pack_forward(layer, x[a:a + 10]) for a in range(0, x.shape[0], 10)]), scale, heads)
    for ours, theirs in zip(got, want):
        assert torch.equal(ours, theirs)


def test_a_layer_that_cannot_be_read_is_refused_naming_its_class():
    x = torch.randn(5, 64)
    raw = torch.nn.Linear(64, 192, bias=False)
    raw.weight = torch.nn.Parameter(torch.zeros(192, 68, dtype=torch.uint8), requires_grad=False)  # blocks of bytes
    with pytest.raises(RuntimeError, match=r"cannot read the weights of a torch\.nn\.modules\.linear\.Linear layer: "
                                           r"its weight cast to the input's dtype returned a Tensor whose storage "
                                           r"has shape \(192, 68\), expected \(192, 64\)"):
        with qkv_projection(raw, x, 2, 32):
            pass

    class PairlessCast(PackCastLinear):
        def cast_bias_weight(self, input=None, **kwargs):
            return super().cast_bias_weight(input)[0]
    with pytest.raises(RuntimeError, match=r"PairlessCast layer: its own cast_bias_weight returned a Tensor, "
                                           r"expected a \(weight, bias\) pair"):
        with qkv_projection(PairlessCast(torch.randn(192, 64)), x, 2, 32):
            pass

    class WideForward(torch.nn.Linear):
        def forward(self, rows):
            return torch.cat([super().forward(rows)] * 2, dim=1)
    with qkv_projection(WideForward(64, 192, bias=False), x, 2, 32) as projection:
        with pytest.raises(RuntimeError, match=r"WideForward layer: its own forward returned torch\.Size\(\[5, 384\]\) "
                                               r"for rows of shape \(5, 64\), expected \(5, 192\)"):
            projection.for_heads((0, 2))(x)


class StreamedCastLinear(PackCastLinear):
    """A pack's layer whose cast fetches its weight (streamed weights): each cast counted."""


@pytest.mark.parametrize("path", ["cast", "forward"])
def test_a_streamed_layer_is_cast_once_per_block_call_on_every_weight_path(path):
    """Three chunks of rows and two head groups: six forward calls on the forward path (an on-the-fly LoRA's
    weight function set), yet one cast a block call, as on the cast path; the output is the layer's own, and
    the layer's own cast is back afterwards (the next block call casts once again)."""
    x, w, scale, _ = inputs()
    layer = StreamedCastLinear(w)
    if path == "forward":
        layer.weight_function = [lambda weight: weight]
    assert weight_path(layer) == path
    for block_call in (1, 2):
        with qkv_projection(layer, x, H, D) as projection:
            groups = [producer.produce_qkv(x, projection, None, H, D, scale, scale, 1e-6, None, heads, chunk_rows=10)
                      for heads in ((0, 2), (2, 3))]
        assert layer.casts == block_call and "cast_bias_weight" not in vars(layer)
    expected = project_rows(layer.forward_comfy_cast_weights(x), scale, (0, 3))
    for got, want in zip(groups[0] + groups[1], [t[:, :2] for t in expected] + [t[:, 2:] for t in expected]):
        torch.testing.assert_close(got, want)
