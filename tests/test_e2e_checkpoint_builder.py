"""The e2e benchmark's random-checkpoint builder: a tensor at a time, deterministic, ComfyUI's format.

`save_random_h3` lists the model's tensors on the meta device, then makes, quantises and stores
one tensor at a time through `SafetensorsWriter`. Without ComfyUI a stand-in module takes H3's
place (its key names, a norm, biases, an fp32 layer, the rotary buffer); with COMFYUI_PATH the
tiny random H3 is built, compared with the model's own state dict and with `quantise_state_dict`
of the same float weights, and loaded through UNETLoader.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from comfyui_harness import comfy, needs_comfyui, sample  # noqa: F401 (comfy is a fixture)

from adaptive_sparse_attention.bench import checkpoints, e2e


class Block(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(hidden, dtype=dtype)
        self.attn = nn.Module()
        self.attn.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=False, dtype=dtype)
        self.attn.q_norm = nn.RMSNorm(hidden // 2, dtype=dtype)
        self.attn.out_proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(hidden, 4 * hidden, bias=False, dtype=dtype)
        self.mlp.fc2 = nn.Linear(2 * hidden, hidden, bias=False, dtype=dtype)
        self.adaln = nn.Linear(hidden // 2, 6 * hidden, dtype=dtype)  # a bias: N(0, 0.02)


class StandIn(nn.Module):
    """H3's kinds of tensors under H3's key names: bf16 blocks, an fp32 island, the rotary buffer."""

    def __init__(self, blocks: int = 2, hidden: int = 64, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.video_patch_proj = nn.Linear(24, hidden, dtype=torch.float32)
        self.rope = nn.Module()
        self.rope.register_buffer("inv_freq", torch.empty(4, dtype=torch.float32))
        self.blocks = nn.ModuleList([Block(hidden, dtype) for _ in range(blocks)])
        self.final_norm = nn.RMSNorm(hidden, dtype=dtype)


def specs_of(sd: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {key: (tuple(t.shape), t.dtype) for key, t in sd.items()}


def header(path: Path) -> dict:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n])


# ---------------------------------------------------------------- without ComfyUI


def test_meta_specs_list_the_state_dict_without_making_it():
    assert e2e.meta_specs(StandIn) == specs_of(StandIn().state_dict())
    # 2 x 100,000^2 fp32 weights (80 GB): listed, never allocated
    huge = e2e.meta_specs(lambda: nn.Sequential(nn.Linear(100_000, 100_000), nn.Linear(100_000, 100_000)))
    assert huge["1.weight"] == ((100_000, 100_000), torch.float32)
    assert list(huge) == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_writer_stores_what_save_file_stores_aligned_and_the_same_bytes_twice(tmp_path: Path):
    g = torch.Generator().manual_seed(0)
    tensors = {"i8": torch.randint(-128, 127, (4, 8), generator=g, dtype=torch.int8),
               "marker": torch.tensor(list(b'{"format": "int8"}'), dtype=torch.uint8),
               "scalar": torch.tensor(2.5), "bf16": torch.randn(3, 5, generator=g).bfloat16(),
               "empty": torch.zeros(0, 4), "f8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
               "f64": torch.randn(2, 3, generator=g, dtype=torch.float64), "mask": torch.tensor([True, False, True]),
               "f32": torch.randn(3, generator=g)}
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for path in paths:
        with checkpoints.SafetensorsWriter(path, checkpoints.header_bound(tensors)) as out:
            for name, t in tensors.items():
                out.add(name, t)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    safetensors.torch.save_file(tensors, str(tmp_path / "reference.safetensors"))
    reference = safetensors.torch.load_file(str(tmp_path / "reference.safetensors"))
    back = safetensors.torch.load_file(str(paths[0]))
    assert specs_of(back) == specs_of(reference)
    for name, t in reference.items():
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    with safetensors.safe_open(str(paths[0]), "pt") as f:  # safetensors' own reader, lazily
        assert sorted(f.keys()) == sorted(tensors)
        assert f.metadata() is None
    sizes = {"I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4, "F64": 8}
    for name, entry in header(paths[0]).items():  # every tensor at an offset its element size divides
        assert entry["data_offsets"][0] % sizes[entry["dtype"]] == 0, name


def test_writer_refuses_and_removes_a_partial_file(tmp_path: Path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="'a' was added already"):
        with checkpoints.SafetensorsWriter(path, 1024) as out:
            out.add("a", torch.zeros(2))
            out.add("a", torch.zeros(2))
    assert not path.exists()
    with pytest.raises(ValueError, match="'m' is on meta; move it to the CPU first"):
        with checkpoints.SafetensorsWriter(path, 1024) as out:
            out.add("m", torch.zeros(2, device="meta"))
    assert not path.exists()
    with pytest.raises(ValueError, match=r"the header needs \d+ bytes, 8 were reserved"):
        with checkpoints.SafetensorsWriter(path, 8) as out:
            out.add("a_long_name", torch.zeros(2))
    assert not path.exists()


def test_random_checkpoint_has_the_modules_tensors_and_the_same_bytes_twice(tmp_path: Path):
    cpu = torch.device("cpu")
    specs = e2e.meta_specs(StandIn)
    paths = [tmp_path / f"{name}.safetensors" for name in ("a", "b", "seed1")]
    for path, seed in zip(paths, (0, 0, 1)):
        stats = e2e.write_random_checkpoint(path, specs, cpu, seed=seed)
    assert stats == {"largest_tensor_gib": 4 * 64 * 64 * 2 / 2 ** 30}  # mlp.fc1, bf16; no device peak on the CPU
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()
    sd = safetensors.torch.load_file(str(paths[0]))
    assert specs_of(sd) == specs_of(StandIn().state_dict())
    assert list(header(paths[0])) == list(specs)  # stored in the model's order (no tensor held back here)
    assert torch.equal(sd["blocks.1.attn.q_norm.weight"], torch.ones(32, dtype=torch.bfloat16))
    assert torch.equal(sd["final_norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert sd["blocks.1.norm1.weight"].abs().max() < 0.2  # not "norm.weight": small random, as before the builder
    assert torch.equal(sd["rope.inv_freq"], 1.0 / 10000.0 ** (torch.arange(4, dtype=torch.float32) / 4))
    bias = sd["blocks.0.adaln.bias"].float()
    assert 0.01 < bias.std() < 0.04 and bias.abs().max() < 0.2
    for key, fan_in in (("blocks.0.attn.qkv_proj.weight", 64), ("blocks.1.mlp.fc2.weight", 128),
                        ("video_patch_proj.weight", 24)):
        assert sd[key].float().std() == pytest.approx(fan_in ** -0.5, rel=0.1), key
    assert not torch.equal(sd["blocks.0.attn.qkv_proj.weight"], sd["blocks.1.attn.qkv_proj.weight"])
    # each tensor has its own generator: a shallower model's blocks are the deeper one's
    e2e.write_random_checkpoint(tmp_path / "one.safetensors", e2e.meta_specs(lambda: StandIn(blocks=1)), cpu)
    one = safetensors.torch.load_file(str(tmp_path / "one.safetensors"))
    assert all(torch.equal(t, sd[key]) for key, t in one.items())


def test_random_checkpoint_refuses_unknown_formats_and_models_without_block_weights(tmp_path: Path):
    specs = e2e.meta_specs(StandIn)
    with pytest.raises(ValueError, match="weights='int4' is not a format; allowed: bf16, int8_convrot"):
        e2e.write_random_checkpoint(tmp_path / "x.safetensors", specs, torch.device("cpu"), "int4")
    with pytest.raises(ValueError, match=r"no DiT block Linear weights \(blocks.N.attn/mlp\) to store in fp8"):
        e2e.write_random_checkpoint(tmp_path / "x.safetensors", e2e.meta_specs(lambda: nn.Linear(4, 4)),
                                    torch.device("cpu"), "fp8")
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(ValueError, match="seed=-1: expected a whole number >= 0"):
        e2e.tensor_seed("a", -1)


BUILD = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from adaptive_sparse_attention.bench import e2e

    def rss(field):  # this process's resident bytes: now (VmRSS) or at its peak (VmHWM; getrusage's maxrss
        with open("/proc/self/status") as f:  # would count the parent's size at the fork)
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    blocks, rows, cols = int(sys.argv[2]), 4096, 8192
    build = lambda: nn.Sequential(*(nn.Linear(cols, rows, bias=False, dtype=torch.bfloat16) for _ in range(blocks)))
    specs = e2e.meta_specs(build)
    torch.randn(rows, cols, dtype=torch.bfloat16).mul_(2.0)  # the allocator's and randn's first-use costs
    before = rss("VmRSS")
    e2e.write_random_checkpoint(sys.argv[1], specs, torch.device("cpu"))
    print(max(0, rss("VmHWM") - before) / (rows * cols * 2))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident size from /proc")
def test_the_build_holds_about_one_tensor_in_host_memory(tmp_path: Path):
    """Eight 64 MiB tensors (a 512 MiB file): the build's peak resident memory grows by one tensor (the
    next is made after the last is freed), not by the checkpoint (the file's pages are the kernel's)."""
    out = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path / "m.safetensors"), "8"], capture_output=True,
                         text=True, check=True)
    tensors = float(out.stdout.split()[-1])
    assert tensors < 1.5, f"the build's peak grew by {tensors:.2f} tensors of 64 MiB"
    assert (tmp_path / "m.safetensors").stat().st_size > 8 * 64 * 2 ** 20


def test_cli_takes_the_models_full_depth():
    from adaptive_sparse_attention.bench.cli import build_parser

    assert build_parser().parse_args(["e2e", "--blocks", "50"]).blocks == 50


# ---------------------------------------------------------------- real ComfyUI

TINY = e2e.SCALES["tiny"].model


@needs_comfyui
def test_tiny_h3_has_the_models_tensors_and_quantise_state_dicts_format(comfy, tmp_path: Path):
    import comfy.ops
    from comfy.ldm.minimax.model import MiniMaxH3Model

    cpu = torch.device("cpu")
    model = MiniMaxH3Model(**TINY, num_layers=2, dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init)
    expected = specs_of(model.state_dict())
    assert e2e.h3_specs(TINY, 2) == expected
    plain = tmp_path / "bf16.safetensors"
    e2e.save_random_h3(plain, TINY, 2, cpu)
    sd = safetensors.torch.load_file(str(plain))
    assert specs_of(sd) == expected
    assert torch.equal(sd["blocks.0.attn.q_norm.weight"], torch.ones(32, dtype=torch.bfloat16))
    assert sd["final_layer.video_out.weight"].dtype == torch.float32
    assert torch.equal(sd["rope.inv_freq"], 1.0 / 10000.0 ** (torch.arange(4, dtype=torch.float32) / 4))
    # int8_convrot: the keys, dtypes, values and comfy_quant markers quantise_state_dict gives the same weights
    quantised = [tmp_path / "int8_a.safetensors", tmp_path / "int8_b.safetensors"]
    for path in quantised:
        e2e.save_random_h3(path, TINY, 2, cpu, "int8_convrot")
    assert quantised[0].read_bytes() == quantised[1].read_bytes()
    reference = checkpoints.quantise_state_dict(sd, "int8_convrot", convrot_groupsize=64)
    q = safetensors.torch.load_file(str(quantised[0]))
    assert specs_of(q) == specs_of(reference)
    for key, t in reference.items():
        assert torch.equal(q[key], t), key
    marker = json.loads(bytes(q["blocks.1.mlp.fc2.comfy_quant"].tolist()))
    assert marker == {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64}
    assert q["blocks.0.attn.qkv_proj.weight"].dtype == torch.int8


@needs_comfyui
def test_tiny_h3_loads_through_unetloader_and_samples(comfy, tmp_path: Path):
    base, nodes = comfy
    folder = base / "models" / "diffusion_models"
    for weights in ("bf16", "int8_convrot"):
        name = f"builder_tiny_{weights}.safetensors"
        e2e.save_random_h3(folder / name, TINY, 2, torch.device("cpu"), weights)
        patcher = nodes.UNETLoader().load_unet(name, "default")[0]
        net = patcher.model.diffusion_model
        assert len(net.blocks) == 2
        fmt = getattr(net.blocks[1].attn.qkv_proj, "quant_format", None)
        assert fmt == (None if weights == "bf16" else "int8_tensorwise"), weights
        assert torch.isfinite(sample(nodes, patcher, steps=2)).all(), weights


@needs_comfyui
def test_full_depth_h3_is_listed_without_memory_and_built_a_tensor_at_a_time(comfy):
    """H3's 50 full-width blocks in int8_convrot: 43.8 GiB (18 GiB of int8 block Linears, 25.8 GiB of bf16 and
    fp32, most of it the blocks' adaLN projections), the largest tensor 496 MiB (an adaLN projection), so the
    builder's device peak is a tensor's, not the model's."""
    specs = e2e.h3_specs(e2e.SCALES["h3"].model, 50)
    assert sum(key.endswith("attn.qkv_proj.weight") and key.startswith("blocks.") for key in specs) == 50
    sizes = {key: torch.Size(shape).numel() * (1 if checkpoints.QUANTISED.match(key) else dtype.itemsize)
             for key, (shape, dtype) in specs.items()}
    assert 40 * 2 ** 30 < sum(sizes.values()) < 60 * 2 ** 30
    assert max(sizes.values()) < 2 ** 30
