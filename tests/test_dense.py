"""Dense blocks on the fastest exact kernel: the measured choice, its saved copy and the override.

The candidates themselves need a GPU; on the CPU the choice logic runs with fake kernels and
timings against a reference output, the tolerance is held to CPU SDPA in bfloat16/float16, and the
override to an independent float64 softmax attention.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re

import pytest
import torch

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.nodes.model_patches import BlockReplacement
from adaptive_sparse_attention.nodes.dense_override import DenseOverride
from adaptive_sparse_attention.nodes.block_hook import CallContext
from adaptive_sparse_attention.nodes.sparse_policy import SparseAttentionHook
from adaptive_sparse_attention.kernels.dense import choice as dense
from adaptive_sparse_attention.kernels.flash4.family import FLASH4


def notes():
    """A `note` that records its messages."""
    seen = []
    return seen, lambda message, level=None: seen.append(message)


def fake_kernels(outputs: dict, times: dict):
    """`run` and `time_ms` over fixed outputs (a value that is an exception is raised) and times."""
    last = []

    def run(name):
        last.append(name)
        if isinstance(outputs[name], Exception):
            raise outputs[name]
        return outputs[name]

    def time_ms(fn):
        fn()
        return times[last[-1]]

    return run, time_ms


REFERENCE = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
TOL = dense.tolerance(torch.bfloat16)


def test_fastest_rejects_a_wrong_first_kernel_against_the_float32_reference():
    outputs = {"cudnn": REFERENCE.flip(0),  # heads swapped: the first and fastest, but wrong
               "flash": REFERENCE * (1 + 1e-3), "efficient": REFERENCE * (1 - 2e-3)}
    run, time_ms = fake_kernels(outputs, {"cudnn": 1.0, "flash": 3.0, "efficient": 2.0})
    seen, note = notes()
    assert dense.fastest(dense.CANDIDATES, run, time_ms, REFERENCE, TOL, note) == "efficient"
    assert len(seen) == 1
    assert "cudnn differs from the float32 reference" in seen[0]


def test_fastest_skips_candidates_that_raise_or_run_out_of_memory_and_breaks_ties_by_order():
    outputs = {"cudnn": RuntimeError("No available kernel"),
               "flash": torch.cuda.OutOfMemoryError("CUDA out of memory"), "efficient": REFERENCE}
    run, time_ms = fake_kernels(outputs, {"efficient": 1.0})
    seen, note = notes()
    assert dense.fastest(dense.CANDIDATES, run, time_ms, REFERENCE, TOL, note) == "efficient"
    assert len(seen) == 2
    assert "OutOfMemoryError" in seen[1]
    run, time_ms = fake_kernels({"cudnn": REFERENCE, "flash": REFERENCE, "efficient": REFERENCE}, dict.fromkeys(outputs, 1.0))
    assert dense.fastest(dense.CANDIDATES, run, time_ms, REFERENCE, TOL, note) == "cudnn"

    def oom_while_timed(fn):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    assert dense.fastest(dense.CANDIDATES, run, oom_while_timed, REFERENCE, TOL, note) is None
    run, time_ms = fake_kernels(dict.fromkeys(outputs, RuntimeError("No available kernel")), {})
    assert dense.fastest(dense.CANDIDATES, run, time_ms, REFERENCE, TOL, note) is None


def test_tolerance_accepts_low_precision_rounding_and_rejects_a_wrong_kernel():
    """CPU SDPA in bfloat16/float16 (rounded probabilities and output) is accepted; a wrong scale or
    a head mix-up in the same dtype is not."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = (torch.randn(1, 3, 512, 64, generator=g).to(dtype) for _ in range(3))
        reference = dense.reference_attention(q, k, v)
        torch.testing.assert_close(reference.double(), dense.probe(exact_attention(q, k, v)), rtol=0, atol=1e-5)
        run = {"right": lambda: dense.sdpa(q, k, v, None),
               "scale": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5),
               "heads": lambda: dense.sdpa(q, k, v, None).roll(1, dims=1)}
        seen, note = notes()
        ok = {name: dense.agrees(name, lambda n: dense.probe(run[n]()), reference, dense.tolerance(dtype), note)
              for name in run}
        assert ok == {"right": True, "scale": False, "heads": False}, (dtype, seen)


def resolve_with(choices, key, outputs, times=None, allowed=dense.CANDIDATES):
    """`resolve` with fake kernels: the saved choice is checked, a miss measured (returns choice, measured?)."""
    run, time_ms = fake_kernels(outputs, times or dict.fromkeys(outputs, 1.0))
    measured = []

    def measure():
        measured.append(key)
        return dense.fastest(allowed, run, time_ms, REFERENCE, TOL, choices.note)

    choice = choices.resolve(key, allowed, lambda name: dense.agrees(name, run, REFERENCE, TOL, choices.note), measure)
    return choice, bool(measured)


def test_resolve_measures_once_and_later_processes_check_the_saved_choice(tmp_path):
    path = tmp_path / "choices.json"
    good = {"cudnn": REFERENCE, "flash": REFERENCE, "efficient": REFERENCE}
    first = dense.DenseChoices(path)
    assert resolve_with(first, "gpu|bf16|D128", good, {"cudnn": 2.0, "flash": 1.0, "efficient": 3.0}) == ("flash", True)
    assert resolve_with(first, "gpu|bf16|D128", good) == ("flash", False)
    assert json.loads(path.read_text()) == {"gpu|bf16|D128": "flash"}
    later = dense.DenseChoices(path)  # a new process: reads the file, checks the kernel runs, does not measure
    assert resolve_with(later, "gpu|bf16|D128", good) == ("flash", False)
    assert later.lookup("gpu|bf16|D128", lambda: pytest.fail("measured again")) == "flash"


def test_a_saved_choice_that_does_not_run_here_is_measured_again_and_the_file_updated(tmp_path):
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"k": "flash", "other": "cudnn"}))
    outputs = {"cudnn": REFERENCE, "flash": RuntimeError("No viable backend"), "efficient": REFERENCE}
    choices = dense.DenseChoices(path)
    assert resolve_with(choices, "k", outputs, {"cudnn": 2.0, "efficient": 1.0}) == ("efficient", True)
    assert json.loads(path.read_text()) == {"k": "efficient", "other": "cudnn"}
    path.write_text(json.dumps({"k": "no-such-kernel"}))  # damaged, or not allowed for these inputs
    assert resolve_with(dense.DenseChoices(path), "k", outputs) == ("cudnn", True)
    path.write_text(json.dumps({"k|wide rows": "efficient"}))
    assert resolve_with(dense.DenseChoices(path), "k|wide rows", outputs, allowed=("cudnn", "flash")) == ("cudnn", True)


def test_when_no_candidate_runs_nothing_is_saved_and_a_later_process_measures_again(tmp_path, caplog):
    path = tmp_path / "choices.json"
    failing = dict.fromkeys(dense.CANDIDATES, RuntimeError("temporarily out of memory"))
    choices = dense.DenseChoices(path)
    with caplog.at_level("INFO", logger="adaptive_sparse_attention"):
        assert resolve_with(choices, "k", failing) == (None, True)
        assert resolve_with(choices, "k", failing) == (None, False)  # this process keeps SDPA's own choice
    assert not path.exists()
    told = [r for r in caplog.records if "SDPA's own choice" in r.getMessage()]
    assert len(told) == 1
    assert told[0].levelname == "WARNING"
    assert resolve_with(dense.DenseChoices(path), "k", {**failing, "cudnn": REFERENCE}) == ("cudnn", True)
    assert json.loads(path.read_text()) == {"k": "cudnn"}


def test_memory_is_bounded_and_resettable(tmp_path):
    choices = dense.DenseChoices(tmp_path / "choices.json")
    for i in range(dense.MAX_CHOICES + 5):
        choices.remember(f"k{i}", "flash")
    assert len(choices.choices) == dense.MAX_CHOICES
    assert "k0" not in choices.choices
    choices.reset()
    assert not choices.choices


def test_the_key_names_the_pack_version_gpu_and_libraries(monkeypatch):
    from adaptive_sparse_attention import __version__

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(dense, "driver_version", lambda: "13000")
    key = dense.device_key(torch.device("cuda", 0))
    assert key.startswith(f"pack {__version__}|Some GPU|sm90|driver 13000|torch {torch.__version__}|cudnn ")
    assert key.endswith(f"|triton {dense.triton_version()}")  # a choice measured with another build is not found
    assert dense.triton_version() != "none" or importlib.util.find_spec("triton") is None
    choices = dense.DenseChoices()
    q = torch.empty(1, 4, 300, 64, dtype=torch.bfloat16, device="meta")
    choices.devices[q.device.index] = key  # as `describe_device` leaves it for a GPU
    assert choices.key(q, q, q) == f"{key}|torch.bfloat16|D64|H4|keys<=512|bf16|host none"
    host = dense.HostAttention("comfy.ldm.modules.attention.attention_sage", lambda *a: None, eight_bit=True)
    assert choices.key(q, q, q, host, "8-bit") == (f"{key}|torch.bfloat16|D64|H4|keys<=512|8-bit"
                                                  "|host comfy.ldm.modules.attention.attention_sage")


def test_default_cache_path(tmp_path, monkeypatch):
    monkeypatch.delenv(dense.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert dense.default_cache_path() == tmp_path / "adaptive_sparse_attention" / "dense_kernels.json"
    user = tmp_path / "user"
    assert dense.default_cache_path(user) == user / "adaptive_sparse_attention" / "dense_choices.json"
    monkeypatch.setenv(dense.CACHE_ENV, str(tmp_path / "mine.json"))
    assert dense.default_cache_path(user) == tmp_path / "mine.json"
    assert dense.DenseChoices().path == tmp_path / "mine.json"


@pytest.mark.parametrize("where", ["/", "a directory"])
def test_a_cache_path_that_is_no_file_keeps_choices_in_memory_with_one_warning(where, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(dense.CACHE_ENV, where if where == "/" else str(tmp_path))
    choices = dense.DenseChoices()
    with caplog.at_level("WARNING", logger="adaptive_sparse_attention"):
        for key in ("k1", "k2"):
            assert resolve_with(choices, key, dict.fromkeys(dense.CANDIDATES, REFERENCE)) == ("cudnn", True)
            assert resolve_with(choices, key, {}) == ("cudnn", False)
    assert len(caplog.records) == 1
    assert "kept in memory only" in caplog.records[0].getMessage()
    assert list(tmp_path.iterdir()) == []


def test_cpu_runs_sdpa_default(tmp_path):
    choices = dense.DenseChoices(tmp_path / "choices.json")
    q = torch.randn(1, 2, 5, 8)
    assert choices.choice(q, q, q) is None
    out, kernel = choices.attention(q, q, q)
    torch.testing.assert_close(out.double(), exact_attention(q, q, q), rtol=0, atol=1e-6)
    assert kernel is None
    assert not (tmp_path / "choices.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_choice_is_exact_saved_and_checked_again(dtype, tmp_path):
    path = tmp_path / "choices.json"
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1000, 64, generator=g, device="cuda", dtype=dtype) for _ in range(3))
    choices = dense.DenseChoices(path)
    out, _ = choices.attention(q, k, v)
    key = choices.key(q, k, v)
    assert dense.relative_l2(out, exact_attention(q, k, v).float()) <= dense.tolerance(dtype)
    saved = json.loads(path.read_text())
    assert saved[key] in choices.candidates(q, k, v, None, "bf16")  # SDPA's kernels, FlashAttention-4 where installed
    if dtype == torch.float32:  # a saved choice that cannot take these inputs is measured again
        path.write_text(json.dumps({key: "flash"}))
        again = dense.DenseChoices(path)
        assert again.choice(q, k, v) == saved[key] == json.loads(path.read_text())[key] != "flash"


def exact_attention(q, k, v):
    """Softmax attention in float64, [B, H, S, D]."""
    w = torch.softmax(q.double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5, -1)
    return w @ v.double()


@pytest.mark.parametrize("skip_reshape", [True, False])
@pytest.mark.parametrize("skip_output_reshape", [True, False])
def test_override_computes_exact_attention_in_comfyui_shapes(skip_reshape, skip_output_reshape):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 37, 16, generator=g) for _ in range(3))
    ref = exact_attention(q, k, v)
    args = (q, k, v) if skip_reshape else tuple(t.transpose(1, 2).reshape(1, 37, 48) for t in (q, k, v))

    def comfy_attention(*a, **kw):
        raise AssertionError("the override serves this call itself")

    out = DenseOverride(dense.DenseChoices())(comfy_attention, *args, 3, skip_reshape=skip_reshape,
                            skip_output_reshape=skip_output_reshape, transformer_options={}, _inside_attn_wrapper=True)
    if not skip_output_reshape:
        out = out.view(1, 37, 3, 16).transpose(1, 2)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-6)  # fp32 SDPA against float64


def test_override_hands_masked_calls_to_comfyui():
    calls = []
    q = torch.randn(1, 2, 4, 8)
    DenseOverride(dense.DenseChoices())(lambda *a, **kw: calls.append(kw) or q, q, q, q, 2, mask=torch.zeros(4, 4), skip_reshape=True,
                    transformer_options={}, _inside_attn_wrapper=True)
    assert calls
    assert calls[0]["mask"] is not None
    assert calls[0]["_inside_attn_wrapper"]


@pytest.mark.parametrize("setting,other,expected", [
    ("fastest", None, "ours"), ("comfyui", None, None), ("fastest", "theirs", "theirs")])
def test_dense_blocks_get_the_override(setting, other, expected):
    hook = SparseAttentionHook(SparseConfig(warmup_mode="dense", dense_attention=setting))
    model = torch.nn.Module()
    model.blocks = [torch.nn.Module()]
    model.blocks[0].attn = torch.nn.Module()
    replacement = BlockReplacement(hook.key, 0, via_args=True, previous=None)
    to = {"sigmas": torch.tensor([1.0]), "sample_sigmas": torch.tensor([1.0, 0.0])}
    to[hook.key] = CallContext(hook, model, *hook.tracker.step_of(to))
    if other is not None:
        to["optimized_attention_override"] = other
    seen = []
    args = {"img": torch.zeros(3, 4), "transformer_options": to}
    replacement(args, {"original_block": lambda a: seen.append(a["transformer_options"]) or a})
    assert seen[0].get("optimized_attention_override") is (hook.dense_override if expected == "ours" else expected)
    assert to.get("optimized_attention_override") is other  # the caller's options are not changed


# --- the host's own attention (ComfyUI's as launched) and FlashAttention-4 as candidates --------------------


def host_of(fn, identity="comfy.ldm.modules.attention.attention_pytorch", eight_bit=False):
    return dense.HostAttention(identity, fn, eight_bit, label=f"ComfyUI's attention {identity}")


def test_tolerance_of_each_precision():
    """bf16 runs allow 3 units of an exact kernel's rounding error (9.6e-3 in bfloat16: the exact kernels'
    2.3e-3 passes, Sage's 1.3e-2 and comfy-kitchen INT8's 1.7e-2 do not); 8-bit runs 10 units (3.2e-2)."""
    unit = dense.rounding_error(torch.bfloat16)
    assert unit == pytest.approx(3.19e-3, rel=1e-2)
    bf16, eight = dense.tolerance(torch.bfloat16), dense.tolerance(torch.bfloat16, "8-bit")
    assert 2.3e-3 < bf16 < 1.3e-2
    assert 1.7e-2 < eight < 0.1
    assert dense.tolerance(torch.bfloat16, "bf16", sdpa_error=2.3e-3) == bf16  # below the floor: the floor
    assert dense.tolerance(torch.bfloat16, "bf16", sdpa_error=4e-3) == pytest.approx(3 * 4e-3)
    assert dense.tolerance(torch.bfloat16, "bf16", sdpa_error=1.0) == pytest.approx(6 * unit)  # at most 2 units
    assert dense.tolerance(torch.float32) == pytest.approx(3 * 2 ** -11 * (2 / 3) ** 0.5)
    with pytest.raises(ValueError, match=r"precision='int8' is not allowed: expected one of bf16, 8-bit"):
        dense.tolerance(torch.bfloat16, "int8")


def test_candidate_list(monkeypatch):
    choices = dense.DenseChoices()
    q = torch.randn(1, 2, 8, 16)
    plain, eight = host_of(lambda *a: None), host_of(lambda *a: None, "sageattention.core.sageattn", True)
    assert choices.candidates(q, q, q, None, "bf16") == (dense.DEFAULT,)
    assert choices.candidates(q, q, q, plain, "bf16") == (dense.DEFAULT, dense.HOST)
    seen, choices.note = notes()
    assert choices.candidates(q, q, q, eight, "bf16") == (dense.DEFAULT,)  # an 8-bit function in a bf16 run
    assert seen == ["dense kernel ComfyUI's attention sageattention.core.sageattn is not a candidate: it computes "
                    "in 8-bit and this run's precision is bf16"]
    assert choices.candidates(q, q, q, eight, "8-bit") == (dense.DEFAULT, dense.HOST)
    runs = dataclasses.replace(FLASH4, unavailable=lambda q: None)  # as on an sm90 GPU with flash-attn-4
    monkeypatch.setattr(dense, "DENSE_KERNELS", (runs,))
    assert choices.candidates(q, q, q, plain, "bf16") == (dense.DEFAULT, "flash4", dense.HOST)
    assert choices.kernel("flash4", None) is FLASH4.attention


def test_flash4_says_why_it_cannot_run_here():
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    assert FLASH4.unavailable(q) == "needs a CUDA GPU"
    assert dense.LABELS[FLASH4.name] == "FlashAttention-4"


class StubTimer:
    """Times a thunk as `fast` ms when the host function ran in it, else `slow` ms (CPU timings are
    noise at these sizes)."""

    def __init__(self, host_ms: float, other_ms: float):
        self.host_ms, self.other_ms, self.host_calls = host_ms, other_ms, 0

    def __call__(self, fn):
        before = self.host_calls
        fn()
        return self.host_ms if self.host_calls > before else self.other_ms


def perturbed_host(timer, factor):
    """A host attention: SDPA's output times `factor` (recognisable), counting its calls on `timer`."""
    def run(q, k, v):
        timer.host_calls += 1
        return torch.nn.functional.scaled_dot_product_attention(q, k, v) * factor
    return run


@pytest.mark.parametrize("host_ms,expected", [(1.0, "host"), (3.0, "sdpa")])
def test_the_host_attention_runs_when_it_is_fastest_and_meets_the_bound(host_ms, expected, caplog):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=g) for _ in range(3))
    timer = StubTimer(host_ms, 2.0)
    factor = 1 + 2 ** -12  # relative error 2.4e-4, within the float32 bound of 1.2e-3
    choices = dense.DenseChoices(timer=timer)
    host = host_of(perturbed_host(timer, factor))
    with caplog.at_level("INFO", logger="adaptive_sparse_attention"):
        out, kernel = choices.attention(q, k, v, host)
    assert kernel == expected
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, plain * factor if expected == "host" else plain)
    assert choices.label(kernel, host) == ("ComfyUI's attention comfy.ldm.modules.attention.attention_pytorch"
                                           if expected == "host" else "SDPA's own choice")
    measured = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dense kernels measured")]
    assert len(measured) == 1
    assert "attention_pytorch" in measured[0]
    assert "SDPA's own choice 2 ms" in measured[0]
    calls = timer.host_calls
    assert choices.attention(q, k, v, host)[1] == expected
    assert timer.host_calls == calls + (expected == "host")


def test_a_host_attention_with_wrong_values_is_refused_with_a_clear_report(caplog):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=g) for _ in range(3))
    timer = StubTimer(0.5, 2.0)
    host = host_of(perturbed_host(timer, 1.02))  # 2e-2 off: fast, but beyond a bf16 run's bound
    choices = dense.DenseChoices(timer=timer)
    with caplog.at_level("INFO", logger="adaptive_sparse_attention"):
        out, kernel = choices.attention(q, k, v, host)
    assert kernel == "sdpa"
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    refused = [r for r in caplog.records if "differs from the float32 reference" in r.getMessage()]
    assert len(refused) == 1
    assert refused[0].levelname == "WARNING"
    assert re.fullmatch(r"dense kernel ComfyUI's attention comfy\.ldm\.modules\.attention\.attention_pytorch differs "
                        r"from the float32 reference \(relative L2 2\.0\de-02, more than the 1\.2e-03 allowed\): "
                        r"skipped", refused[0].getMessage()), refused[0].getMessage()


def test_an_8bit_host_attention_is_a_candidate_of_8bit_runs_only():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=g, dtype=torch.bfloat16) for _ in range(3))
    timer = StubTimer(0.5, 2.0)
    host = host_of(perturbed_host(timer, 1.015), "comfy.ldm.modules.attention.attention_comfy_kitchen_int8", True)
    choices = dense.DenseChoices(timer=timer)
    assert choices.attention(q, k, v, host, "bf16")[1] == "sdpa"
    assert timer.host_calls == 0
    out, kernel = choices.attention(q, k, v, host, "8-bit")  # 1.5e-2 off: within the 8-bit bound (3.2e-2)
    assert kernel == "host"
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v) * 1.015)
    assert choices.key(q, k, v, host, "8-bit") != choices.key(q, k, v, host, "bf16")


def test_another_launch_attention_is_measured_again(tmp_path):
    """The key names the host's function: a relaunch with another flag does not reuse the choice."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=g) for _ in range(3))
    timer = StubTimer(1.0, 2.0)
    choices = dense.DenseChoices(tmp_path / "choices.json", timer=timer)
    sage = host_of(perturbed_host(timer, 1.0), "comfy.ldm.modules.attention.attention_sage", True)
    pytorch = host_of(perturbed_host(timer, 1.0))
    assert choices.attention(q, k, v, sage, "8-bit")[1] == "host"
    timer.host_ms = 3.0
    assert choices.attention(q, k, v, pytorch, "8-bit")[1] == "sdpa"
    assert len(choices.choices) == 2  # CPU timings are not saved
    assert not (tmp_path / "choices.json").exists()


def test_override_calls_comfyui_attention_with_its_own_arguments_and_never_recurses():
    """ComfyUI hands the override its attention function; that function may fall back to another wrapped
    ComfyUI attention with the same arguments (as attention_sage falls back to attention_pytorch): with
    `_inside_attn_wrapper` kept, the wrapped function runs itself instead of the override again."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    received, depth = [], []

    def pytorch_inner(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def wrapped_pytorch(*args, **kwargs):  # ComfyUI's wrap_attn: the override unless inside a wrapper already
        to = kwargs.get("transformer_options") or {}
        if "_inside_attn_wrapper" not in kwargs and "optimized_attention_override" in to:
            depth.append(1)
            if len(depth) > 3:
                raise AssertionError("the override was reached again: it dropped _inside_attn_wrapper")
            return to["optimized_attention_override"](pytorch_inner, *args, **kwargs, _inside_attn_wrapper=True)
        return pytorch_inner(*args, **kwargs)

    def sage_like(q, k, v, heads, **kwargs):  # falls back to another wrapped attention with the same kwargs
        received.append(kwargs)
        return wrapped_pytorch(q, k, v, heads, **kwargs)

    timer = StubTimer(1.0, 2.0)
    override = DenseOverride(dense.DenseChoices(timer=timer), precision="8-bit")
    to = {"optimized_attention_override": override}
    out = wrapped_pytorch(q, k, v, 2, skip_reshape=True, skip_output_reshape=True, transformer_options=to)
    assert out.shape == q.shape
    assert len(depth) == 1
    out = override(sage_like, q, k, v, 2, skip_reshape=True, skip_output_reshape=True, transformer_options=to,
                   _inside_attn_wrapper=True)
    assert received and all(kw["_inside_attn_wrapper"] is True and kw["transformer_options"] is to and
                            kw["skip_reshape"] and kw["skip_output_reshape"] for kw in received)
    assert len(depth) == 1  # never reached the override again


def test_a_host_attention_that_reenters_the_override_is_refused_not_deadlocked(caplog):
    """A third-party attention function that calls ComfyUI's attention again without passing
    `_inside_attn_wrapper` reaches the override while it is measuring that very function: the inner call
    raises a clear error (instead of waiting on the lock the measurement holds), the candidate is
    skipped with a warning that says why, and the call runs on the next kernel."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    override = DenseOverride(dense.DenseChoices(timer=StubTimer(1.0, 2.0)))
    to = {"optimized_attention_override": override}
    inner_errors = []

    def drops_the_marker(q, k, v, heads, **kwargs):  # re-enters the override, without _inside_attn_wrapper
        kwargs.pop("_inside_attn_wrapper", None)
        try:
            return override(drops_the_marker, q, k, v, heads, **kwargs)
        except dense.ReentryError as err:
            inner_errors.append(err)
            raise

    with caplog.at_level("INFO", logger="adaptive_sparse_attention"):
        out = override(drops_the_marker, q, k, v, 2, skip_reshape=True, skip_output_reshape=True,
                       transformer_options=to, _inside_attn_wrapper=True)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), rtol=0, atol=0)
    assert inner_errors
    assert "_inside_attn_wrapper" in str(inner_errors[0])
    skipped = [r for r in caplog.records if "cannot run here (ReentryError" in r.getMessage()]
    assert len(skipped) == 1
    assert skipped[0].levelname == "WARNING"


@pytest.mark.parametrize("measured_ahead", [True, False])
def test_a_choice_measured_ahead_leaves_only_the_host_function_to_time(measured_ahead, tmp_path, monkeypatch):
    """`prepare` measures the kernels without a host function; a run's first dense call (ComfyUI's
    function among the candidates, here one that is not SDPA: attention_flash) then times only that choice and
    the host's, so a kernel that lost ahead (here a stand-in for FlashAttention-4, whose first call compiles)
    is never called."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=g) for _ in range(3))
    called = []

    def lost_ahead(q, k, v):
        called.append(q.shape)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    monkeypatch.setattr(dense, "DENSE_KERNELS", (dataclasses.replace(FLASH4, unavailable=lambda q: None,
                                                                     attention=lost_ahead, first_call=""),))
    timer = StubTimer(1.0, 2.0)
    path = tmp_path / "choices.json"
    choices = dense.DenseChoices(path, timer=timer)
    host = host_of(perturbed_host(timer, 1.0), identity="comfy.ldm.modules.attention.attention_flash")
    if measured_ahead:
        dense.ChoiceFile(path).save(choices.key(q, k, v, None, "bf16"), dense.DEFAULT)
    seen, choices.note = notes()
    assert choices.attention(q, k, v, host)[1] == "host"
    assert timer.host_calls > 0
    assert bool(called) is not measured_ahead
    narrowed = [m for m in seen if "was measured fastest ahead" in m]
    assert len(narrowed) == int(measured_ahead)
    if measured_ahead:
        assert "SDPA's own choice was measured fastest ahead" in narrowed[0]
        assert "dense kernels measured" in seen[-1] and "FlashAttention-4" not in seen[-1]


def test_comfyuis_sdpa_attention_takes_the_choice_measured_ahead_untimed(tmp_path, monkeypatch):
    """ComfyUI's default attention (attention_pytorch) is SDPA itself, whose every backend `prepare` measured:
    its run takes the saved choice with nothing checked or timed; without a saved choice it is measured."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=g) for _ in range(3))
    timer = StubTimer(1.0, 2.0)
    path = tmp_path / "choices.json"
    host = host_of(perturbed_host(timer, 1.0))  # attention_pytorch
    choices = dense.DenseChoices(path, timer=lambda fn: pytest.fail("nothing is timed"))
    dense.ChoiceFile(path).save(choices.key(q, k, v, None, "bf16"), dense.DEFAULT)
    seen, choices.note = notes()
    out, kernel = choices.attention(q, k, v, host)
    assert kernel == dense.DEFAULT and timer.host_calls == 0
    assert any("measured ahead by `prepare` among SDPA's kernels" in m for m in seen)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    fresh = dense.DenseChoices(tmp_path / "none.json", timer=timer)
    assert fresh.attention(q, k, v, host)[1] == "host" and timer.host_calls > 0  # nothing saved: measured
