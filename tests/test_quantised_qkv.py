"""Q/K/V of quantised checkpoints: through the layer's own quantised matmul, in our chunks and head groups.

Contract tests (no ComfyUI): the producer asks a `Projection` for one function per head group and
calls it per chunk of rows; the benchmark's checkpoint formats and the refusals of formats a
device does not multiply in.

Against real ComfyUI (COMFYUI_PATH), on the CPU: tiny random H3 checkpoints quantised in the test
by ComfyUI's own functions (bench/checkpoints.py), loaded by UNETLoader, in int8_convrot, int8
row-wise, fp8 (fp8 compute emulated as ComfyUI's `--supports-fp8-compute` does, through
`comfy.model_management.SUPPORT_FP8_OPS`) and nvfp4 (as ComfyUI runs it on a CPU: the format is
disabled there and the weight dequantised; its own fp4 matmul needs a GPU, that case skips with
the reason). Each with and without head groups (KJNodes' `minimax_head_chunks`): our q, k, v
equal the layer's own (captured from `Attention.forward` at the attention call, run on the same
chunks of rows) bit for bit, int8 also against the layer on all rows at once (integer products;
a float GEMM's rounding may change with its row count on the CPU's BLAS), and
a counting hook on `QuantizedTensor.dequantize` shows no dequantisation where ComfyUI has none
and one per call where ComfyUI dequantises, never one per chunk or group.
"""
from __future__ import annotations

import torch
import pytest

from comfyui_harness import CKPT, TINY, comfy, layer_qkv, needs_comfyui, sample, sparse  # noqa: F401

from adaptive_sparse_attention.backend import producer
from adaptive_sparse_attention.bench import checkpoints

H, D, HIDDEN = TINY["num_attention_heads"], TINY["attention_head_dim"], TINY["hidden_size"]


class CountingProjection:
    """A plain weight's projection that records how it is asked."""

    def __init__(self, weight: torch.Tensor):
        self.inner = producer.WeightProjection(weight, None, 3, 8)
        self.groups: list[tuple[int, int]] = []
        self.rows: list[int] = []

    def for_heads(self, heads):
        self.groups.append(heads)
        project = self.inner.for_heads(heads)

        def rows(x):
            self.rows.append(x.shape[0])
            return project(x)
        return rows


def test_producer_asks_a_projection_once_per_group_and_calls_it_per_chunk():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(23, 16, generator=g, dtype=torch.float64), torch.randn(72, 16, generator=g, dtype=torch.float64)
    scale = torch.rand(8, generator=g, dtype=torch.float64) + 0.5
    projection = CountingProjection(w)
    got = producer.produce_qkv(x, projection, None, 3, 8, scale, scale, 1e-6, None, (1, 3), chunk_rows=10)
    want = producer.produce_qkv(x, w, None, 3, 8, scale, scale, 1e-6, None, (1, 3), chunk_rows=23)
    assert projection.groups == [(1, 3)]
    assert projection.rows == [10, 10, 3]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="bias must be None when weight is a Projection"):
        producer.produce_qkv(x, projection, torch.zeros(72), 3, 8, scale, scale, 1e-6, None)


def test_weight_formats_and_refusals():
    assert checkpoints.WEIGHTS == ("bf16", "int8_convrot", "fp8", "nvfp4")
    cpu = torch.device("cpu")
    assert checkpoints.unsupported("bf16", cpu) is None
    assert checkpoints.unsupported("int8_convrot", cpu) is None
    assert "fp8 matmuls need sm89 or newer; the CPU has none" in checkpoints.unsupported("fp8", cpu)
    assert "nvfp4 matmuls need sm100 or newer" in checkpoints.unsupported("nvfp4", cpu)
    assert "allowed: bf16, int8_convrot, fp8, nvfp4" in checkpoints.unsupported("int4", cpu)
    with pytest.raises(ValueError, match="fmt='int4' is not a format; allowed: int8_convrot, int8_rowwise, fp8"):
        checkpoints.quantise_state_dict({}, "int4")


# ---------------------------------------------------------------- real ComfyUI

FORMATS = ("int8_convrot", "int8_rowwise", "fp8", "nvfp4")
GROUPS = {None: [(0, H)], 2: [(0, 1), (1, 2)]}  # minimax_head_chunks -> our head groups


@pytest.fixture(scope="module")
def quantised(comfy):
    """{format: checkpoint file name}, each quantised from the harness's tiny checkpoint."""
    import safetensors.torch

    base, _ = comfy
    folder = base / "models" / "diffusion_models"
    sd = safetensors.torch.load_file(str(folder / CKPT))
    names = {}
    for fmt in FORMATS:
        names[fmt] = f"tiny_h3_{fmt}.safetensors"
        safetensors.torch.save_file(checkpoints.quantise_state_dict(sd, fmt, convrot_groupsize=64),
                                    str(folder / names[fmt]))
    return names


@pytest.fixture
def compute(monkeypatch, request):
    """The formats' arithmetic as ComfyUI picks it at load: fp8 compute emulated for fp8 (what
    `--supports-fp8-compute` sets), the CPU's own answer otherwise."""
    import comfy.model_management as mm

    if request.param == "fp8":
        monkeypatch.setattr(mm, "SUPPORT_FP8_OPS", True)
    return request.param


@pytest.fixture
def dequantisations(monkeypatch):
    """Shapes of every comfy-kitchen dequantisation while the test runs."""
    from comfy.quant_ops import QuantizedTensor

    seen: list[tuple[int, ...]] = []
    original = QuantizedTensor.dequantize

    def counted(self):
        seen.append(tuple(self.shape))
        return original(self)
    monkeypatch.setattr(QuantizedTensor, "dequantize", counted)
    return seen


def block_inputs(seq: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(seq, HIDDEN, generator=g).to(dtype)
    angle = torch.rand(1, seq, 1, 8, generator=g) * 6.0
    rope = torch.stack([torch.stack([angle.cos(), -angle.sin()], -1), torch.stack([angle.sin(), angle.cos()], -1)], -2)
    return x, rope


@needs_comfyui
@pytest.mark.parametrize("chunks", [None, 2])
@pytest.mark.parametrize("compute", FORMATS, indirect=True)
def test_qkv_equals_the_layers_own_bit_for_bit(comfy, quantised, compute, chunks, dequantisations):
    from comfy.quant_ops import QuantizedTensor

    from adaptive_sparse_attention.nodes.comfy_weights import qkv_projection

    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(quantised[compute], "default")[0]
    attn = model.model.diffusion_model.blocks[0].attn
    assert isinstance(attn.qkv_proj.weight, QuantizedTensor)
    # on this CPU ComfyUI multiplies int8 and (emulated) fp8 quantised and dequantises nvfp4
    dequantising = compute == "nvfp4"
    assert attn.qkv_proj._full_precision_mm == dequantising
    x, rope = block_inputs(53, attn.q_norm.weight.dtype)
    rows = 16  # 4 chunks, the last of 5 rows
    whole = layer_qkv(attn, x, rope)
    chunked = [torch.cat(t, dim=2) for t in zip(*(layer_qkv(attn, x[a:a + rows], rope[:, a:a + rows])
                                                   for a in range(0, x.shape[0], rows)))]
    dequantisations.clear()
    with qkv_projection(attn.qkv_proj, x, H, D) as projection:
        for h0, h1 in GROUPS[chunks]:
            got = producer.produce_qkv(x, projection, None, H, D, attn.q_norm.weight, attn.k_norm.weight,
                                       attn.q_norm.eps, rope, (h0, h1), chunk_rows=rows)
            for name, ours, layer, layer_whole in zip("qkv", got, chunked, whole):
                assert torch.equal(ours, layer[:, h0:h1]), f"{compute}: {name} of heads {h0}:{h1} differs from the layer's"
                if compute.startswith("int8"):  # integer products: the same bits whatever the rows per call
                    assert torch.equal(ours, layer_whole[:, h0:h1])
                else:  # a float GEMM's rounding may depend on its row count (CPU BLAS blocking)
                    torch.testing.assert_close(ours, layer_whole[:, h0:h1], rtol=1e-6, atol=1e-6)
    weight_shape = tuple(attn.qkv_proj.weight.shape)
    assert dequantisations == ([weight_shape] if dequantising else []), dequantisations


@needs_comfyui
def test_nvfp4_matmul_on_this_cpu(comfy, quantised, monkeypatch):
    """nvfp4's own matmul, where the CPU runs it: comfy-kitchen's eager scaled_mm on this torch."""
    import comfy_kitchen as ck
    from comfy.quant_ops import QuantizedTensor

    w = QuantizedTensor.from_float(torch.randn(32, 64), "TensorCoreNVFP4Layout")
    a = QuantizedTensor.from_float(torch.randn(16, 64), "TensorCoreNVFP4Layout")
    try:
        ck.scaled_mm_nvfp4(a._qdata, w._qdata, a._params.scale, w._params.scale, a._params.block_scale,
                           w._params.block_scale, out_dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - any failure means this CPU has no nvfp4 matmul
        pytest.skip(f"comfy-kitchen's nvfp4 matmul does not run on this CPU ({err}); ComfyUI dequantises nvfp4 here")
    pytest.fail("nvfp4 matmul runs on this CPU: extend test_qkv_equals_the_layers_own_bit_for_bit to nvfp4 compute")


@needs_comfyui
@pytest.mark.parametrize("layout,kwargs", [
    ("TensorWiseINT8Layout", {}), ("TensorWiseINT8Layout", dict(per_channel=True)),
    ("TensorWiseINT8Layout", dict(per_channel=True, convrot=True, convrot_groupsize=64)),
    ("TensorCoreFP8E4M3Layout", dict(scale="recalculate")), ("TensorCoreNVFP4Layout", {})])
@pytest.mark.parametrize("head_dim", [32, 8])
def test_head_rows_of_a_quantised_weight_are_its_rows(comfy, layout, kwargs, head_dim):
    """A head group's slice of the stored data and scales dequantises to the same rows of the whole
    weight (nvfp4: with its swizzled block scales, groups off its 128-row tiles, and with rows
    padded to 16 where a group has 24)."""
    from comfy.quant_ops import QuantizedTensor

    from adaptive_sparse_attention.nodes.comfy_weights import quantised_rows

    w = QuantizedTensor.from_float(torch.randn(3 * 3 * head_dim, 64, generator=torch.Generator().manual_seed(2)),
                                   layout, **kwargs)
    whole = w.dequantize()
    for heads in ((0, 1), (1, 3), (2, 3)):
        index = producer.head_rows(torch.arange(w.shape[0]), 3, head_dim, heads)
        part = quantised_rows(w, index)
        assert isinstance(part, QuantizedTensor)
        assert part._layout_cls == layout
        assert torch.equal(part.dequantize(), whole[index]), heads


@needs_comfyui
@pytest.mark.parametrize("compute", ["int8_convrot", "fp8"], indirect=True)
def test_sampling_with_head_groups_never_dequantises(comfy, quantised, compute, dequantisations):
    """The whole KSampler run with our node (every block exact) and two head groups: the same
    latent as ComfyUI's dense one on the same checkpoint, and no dequantisation anywhere."""
    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(quantised[compute], "default")[0]
    dense = sample(nodes, model)
    dequantisations.clear()
    ours = sparse(model, topk_ratio=1.0, warmup_ratio=0.0)
    ours.model_options.setdefault("transformer_options", {})["minimax_head_chunks"] = 2
    got = sample(nodes, ours)
    assert dequantisations == []
    assert float((got - dense).norm() / dense.norm()) < 1e-5


@needs_comfyui
@pytest.mark.parametrize("compute", ["int8_convrot"], indirect=True)
def test_weight_patches_on_a_quantised_checkpoint_compose(comfy, quantised, compute):
    """A LoRA-style weight patch on the quantised qkv layers (ComfyUI re-quantises the patched
    weight): our node with head groups samples what ComfyUI samples with the same patch."""
    from comfy.quant_ops import QuantizedTensor

    _, nodes = comfy
    model = nodes.UNETLoader().load_unet(quantised[compute], "default")[0]
    lora = model.clone()
    g = torch.Generator().manual_seed(3)
    for i in range(TINY["num_layers"]):
        key = f"diffusion_model.blocks.{i}.attn.qkv_proj.weight"
        lora.add_patches({key: (0.3 * torch.randn(model.get_model_object(key).shape, generator=g),)}, 1.0)
    dense = sample(nodes, lora)
    assert isinstance(lora.model.diffusion_model.blocks[0].attn.qkv_proj.weight, QuantizedTensor)
    moved = float((dense - sample(nodes, model)).norm() / dense.norm())
    ours = sparse(lora, topk_ratio=1.0, warmup_ratio=0.0)
    ours.model_options.setdefault("transformer_options", {})["minimax_head_chunks"] = 2
    error = float((sample(nodes, ours) - dense).norm() / dense.norm())
    assert moved > 1e-3  # the patch matters; ours follows it
    assert error < 1e-5


@needs_comfyui
@pytest.mark.parametrize("compute", ["int8_rowwise"], indirect=True)
def test_a_layout_that_cannot_be_sliced_is_dequantised_once_per_call(comfy, quantised, compute, dequantisations,
                                                                     monkeypatch):
    """Head groups of a layout without a row slice (mxfp8, convrot_w4a4, ...: here int8 with its
    slice taken away) share one dequantised weight per call: one dequantisation for 2 groups x 4 chunks."""
    from adaptive_sparse_attention.nodes import comfy_weights

    _, nodes = comfy
    attn = nodes.UNETLoader().load_unet(quantised[compute], "default")[0].model.diffusion_model.blocks[0].attn
    monkeypatch.setattr(comfy_weights, "quantised_rows", lambda weight, index: None)
    x, rope = block_inputs(53, attn.q_norm.weight.dtype)
    expected = layer_qkv(attn, x, rope)
    dequantisations.clear()
    with comfy_weights.qkv_projection(attn.qkv_proj, x, H, D) as projection:
        for h0, h1 in GROUPS[2]:
            got = producer.produce_qkv(x, projection, None, H, D, attn.q_norm.weight, attn.k_norm.weight,
                                       attn.q_norm.eps, rope, (h0, h1), chunk_rows=16)
            for ours, layer in zip(got, expected):  # float weight against int8 products: close, not equal
                torch.testing.assert_close(ours, layer[:, h0:h1], rtol=0.05, atol=0.05)
    assert dequantisations == [tuple(attn.qkv_proj.weight.shape)]
