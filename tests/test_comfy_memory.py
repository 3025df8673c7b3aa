"""The e2e's card of N GiB and ComfyUI's memory start-up (bench/comfy_memory.py), with stand-ins of torch.cuda,
ComfyUI's modules (the pinned fork's main.py, model_management and cli_args as read) and comfy-aimdo."""
from __future__ import annotations

import types

import pytest

from adaptive_sparse_attention.bench import comfy_memory
from adaptive_sparse_attention.bench.comfy_memory import GIB

GPU = 80 * GIB


class Cuda:
    """torch.cuda's memory surface: an 80 GiB GPU with `used` bytes taken (by any process)."""

    def __init__(self, used: int):
        self.used, self.fractions = used, []

    def mem_get_info(self, device=None):
        return GPU - self.used, GPU

    def set_per_process_memory_fraction(self, fraction, device):
        self.fractions.append((fraction, device))


def get_free_memory(cuda, active: int, reserved: int) -> int:
    """The fork's comfy.model_management.get_free_memory on CUDA, from what it reads."""
    free_cuda, _ = cuda.mem_get_info(0)
    return free_cuda + reserved - active


def test_a_card_of_24_gib_reports_24_gib_and_the_memory_beyond_it_as_taken():
    cuda = Cuda(used=10 * GIB)
    card = comfy_memory.emulate_card(24, cuda, 0)
    assert card == {"vram_gib": 24, "gpu_gib": 80.0, "allocator_fraction": 0.3}
    assert cuda.fractions == [(0.3, 0)]  # torch's allocator: 24 of 80 GiB
    assert cuda.mem_get_info(0) == (14 * GIB, 24 * GIB)  # get_total_memory -> 24 GiB, total_vram at import
    assert get_free_memory(cuda, active=3 * GIB, reserved=5 * GIB) == 16 * GIB
    cuda.used = 60 * GIB  # past the card: nothing free, never negative
    assert cuda.mem_get_info(0) == (0, 24 * GIB)


@pytest.mark.parametrize("gib", [0, 80, 96, -1])
def test_a_card_must_be_smaller_than_the_gpu(gib):
    with pytest.raises(ValueError, match=rf"--vram-gib {gib}: .* GPU of 80.0 GiB; allowed: more than 0 and less than 80"):
        comfy_memory.emulate_card(gib, Cuda(0), 0)


def test_a_card_needs_a_gpu():
    with pytest.raises(ValueError, match="--vram-gib 24: emulating a card needs a CUDA GPU"):
        comfy_memory.start(args(), 24, None)
    assert comfy_memory.start(args(), None, None)() == "CPU: no GPU memory management"


def test_aimdo_keeps_the_gpu_beyond_the_card_free():
    card = comfy_memory.emulate_card(32, Cuda(0), 0)
    assert comfy_memory.aimdo_headroom(card, 0.0) == 48.0
    assert comfy_memory.aimdo_headroom(card, 1.5) == 49.5  # the user's --vram-headroom on top
    assert comfy_memory.aimdo_headroom(None, 1.5) == 1.5


class Control:
    """comfy_aimdo.control of a given protocol: 'new' (0.4.13: init takes nvml_pressure, init_devices tuples),
    '0.4.10' (init takes simple_vram_headroom only) or '0.4.9' (neither)."""

    def __init__(self, protocol: str = "new", starts: bool = True):
        self.protocol, self.starts, self.inits, self.devices = protocol, starts, [], []

    def init(self, **kwargs):
        allowed = {"new": {"simple_vram_headroom", "nvml_pressure"}, "0.4.10": {"simple_vram_headroom"}}.get(
            self.protocol, set())
        if set(kwargs) - allowed:
            raise TypeError("unexpected keyword")
        self.inits.append(kwargs)

    def init_devices(self, devices):
        devices = list(devices)
        if self.protocol == "0.4.9" and any(isinstance(d, tuple) for d in devices):
            raise TypeError("device tuples")
        self.devices.append(devices)
        return self.starts


def args(**kw):
    base = dict(reserve_vram=None, disable_nvml_pressure=False, enable_dynamic_vram=False, vram_headroom=0.0)
    return types.SimpleNamespace(**{**base, **kw})


def comfy(nvidia: bool = True, torch_version=(2, 9)):
    mm = types.SimpleNamespace(is_nvidia=lambda: nvidia, is_amd=lambda: False, torch_version_numeric=torch_version,
                               get_all_torch_devices=lambda: [types.SimpleNamespace(index=0)])
    patcher = types.SimpleNamespace(ModelPatcher=object, ModelPatcherDynamic=type("ModelPatcherDynamic", (), {}))
    patcher.CoreModelPatcher = patcher.ModelPatcher
    return mm, patcher, types.SimpleNamespace(aimdo_enabled=False)


@pytest.mark.parametrize("protocol,expected", [
    ("new", {"simple_vram_headroom": 2 * GIB, "nvml_pressure": True}), ("0.4.10", {"simple_vram_headroom": 2 * GIB}),
    ("0.4.9", {})])
def test_aimdo_is_loaded_as_mains_protocols_allow(protocol, expected):
    control = Control(protocol)
    assert comfy_memory.start_aimdo(args(reserve_vram=2.0), lambda: True, control)
    assert control.inits == [expected]
    off = Control()
    assert not comfy_memory.start_aimdo(args(), lambda: False, off)  # --disable-dynamic-vram, --highvram, ...
    assert off.inits == []


def test_dynamic_vram_starts_with_the_cards_headroom_and_the_dynamic_patcher():
    mm, patcher, memory = comfy()
    control = Control()
    card = comfy_memory.emulate_card(24, Cuda(0), 0)
    said = comfy_memory.enable_dynamic_vram(args(vram_headroom=0.5), lambda: True, mm, patcher, memory, control, card)
    assert said == "dynamic VRAM on (comfy-aimdo, 56.5 GiB headroom)"
    assert control.devices == [[(0, int(56.5 * GIB))]]
    assert patcher.CoreModelPatcher is patcher.ModelPatcherDynamic and memory.aimdo_enabled


@pytest.mark.parametrize("case,reason", [
    ("not nvidia", "dynamic VRAM off (ComfyUI's arguments or GPU)"), ("torch 2.7", "needs torch 2.8 or later"),
    ("aimdo fails", "comfy-aimdo did not start")])
def test_dynamic_vram_stays_off_where_main_keeps_it_off(case, reason):
    mm, patcher, memory = comfy(nvidia=case != "not nvidia", torch_version=(2, 7) if case == "torch 2.7" else (2, 9))
    control = Control(starts=case != "aimdo fails")
    said = comfy_memory.enable_dynamic_vram(args(), lambda: True, mm, patcher, memory, control, None)
    assert reason in said
    assert patcher.CoreModelPatcher is patcher.ModelPatcher and not memory.aimdo_enabled


def test_an_aimdo_without_per_device_headroom_is_refused_on_an_emulated_card():
    mm, patcher, memory = comfy()
    card = comfy_memory.emulate_card(24, Cuda(0), 0)
    with pytest.raises(RuntimeError, match="no per-device headroom"):
        comfy_memory.enable_dynamic_vram(args(), lambda: True, mm, patcher, memory, Control("0.4.9"), card)
    control = Control("0.4.9")  # on the whole GPU it starts as main.py does
    assert "on" in comfy_memory.enable_dynamic_vram(args(), lambda: True, mm, patcher, memory, control, None)
    assert control.devices == [[0]]
