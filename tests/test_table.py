"""The one table of operations x backends (kernels/registry.py): its choices, its fallbacks, and
install.py printing the same choices as `auto` makes.

Availability is decided from a `Host` (which packages import, the interpreter) and a `Target`
(device, capability, dtype, head dim, block size), so every case runs here without a GPU.
"""
import ast
import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaptive_sparse_attention import SequenceLayout, SparseConfig, sparse_attention
from adaptive_sparse_attention.kernels import BlockSparsePlan, QuerySummaries, registry
from adaptive_sparse_attention.kernels.cudnn import family as cudnn_family
from adaptive_sparse_attention.kernels.registry import FAMILIES, Host, Stage, Target, choose_family
from adaptive_sparse_attention.notices import Notices

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON, CUDNN = "triton", cudnn_family.MODULE
EVERYTHING = Host(frozenset({TRITON, CUDNN}))
CAPABILITIES = ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))
HOSTS = (EVERYTHING, Host(frozenset({TRITON})), Host(), Host(frozenset({CUDNN})))


def auto(target: Target, host: Host = EVERYTHING) -> str:
    return choose_family("auto", target, host)


def test_auto_takes_cudnn_then_triton_on_cuda_else_torch():
    assert auto(Target("cuda", (9, 0), torch.bfloat16, 128, 64)) == "cudnn"
    assert auto(Target("cuda", (9, 0), torch.float16)) == "cudnn"  # head dim and block size not known yet
    assert auto(Target("cuda", (9, 0), torch.bfloat16, 128, 64), Host(frozenset({TRITON}))) == "triton"  # no package
    assert auto(Target("cuda", (8, 9), torch.bfloat16, 128, 64)) == "triton"  # not sm90
    assert auto(Target("cuda", (10, 0), torch.bfloat16, 128, 64)) == "triton"  # sm100: not measured yet
    assert auto(Target("cuda", (9, 0), torch.float32, 128, 64)) == "triton"  # cuDNN takes 16-bit only
    assert auto(Target("cuda", (9, 0), torch.bfloat16, 32, 64)) == "triton"  # head dim 32
    assert auto(Target("cuda", (9, 0), torch.bfloat16, 128, 128)) == "triton"  # block size 128
    assert auto(Target("cuda", (9, 0), torch.float64, 128, 64)) == "torch"  # no fp64 kernel but the reference
    assert auto(Target("cuda", (7, 5), torch.float16, 64, 64)) == "torch"  # older than the Triton kernels
    assert auto(Target("cuda", (9, 0), torch.bfloat16), Host(frozenset({CUDNN}))) == "torch"  # no Triton at all
    assert auto(Target("cpu", None, torch.float32), Host(frozenset({TRITON, CUDNN}), interpret=True)) == "torch"  # auto compiles on CUDA only
    assert auto(Target("mps", None, torch.float32)) == "torch"


def test_auto_takes_the_sm90_kernel_on_hopper_with_a_triton_it_is_written_for():
    """The Gluon kernel needs sm90 exactly, a Triton release whose Gluon API it is written for and no
    interpreter; elsewhere it is unavailable with the reason, and the next family serves."""
    from adaptive_sparse_attention.kernels.sm90.family import SM90

    hopper = Target("cuda", (9, 0), torch.bfloat16, 128, 64)
    for release in ("3.6", "3.7"):
        host = Host(frozenset({TRITON}), releases=frozenset({("triton", release)}))
        assert auto(hopper, host) == "sm90"
        assert auto(Target("cuda", (8, 9), torch.bfloat16, 128, 64), host) == "triton"
        assert auto(Target("cuda", (12, 0), torch.bfloat16, 128, 64), host) == "triton"
        assert auto(Target("cuda", (9, 0), torch.float32, 128, 64), host) == "triton"
        assert auto(Target("cuda", (9, 0), torch.bfloat16, 128, 128), host) == "triton"
        assert auto(hopper, Host(frozenset({TRITON, CUDNN}), releases=host.releases)) == "cudnn"  # preferred first
    old = Host(frozenset({TRITON}), releases=frozenset({("triton", "3.5")}))
    assert auto(hopper, old) == "triton"
    assert SM90.unavailable(hopper, old) == "Triton 3.5: the kernel's Gluon code is written for Triton 3.6 or 3.7"
    assert SM90.unavailable(hopper, Host(frozenset({TRITON}))) == (
        "Triton (release unknown): the kernel's Gluon code is written for Triton 3.6 or 3.7")
    interpreted = Host(frozenset({TRITON}), True, frozenset({("triton", "3.7")}))
    assert SM90.unavailable(hopper, interpreted) == ("Triton runs under its CPU interpreter (TRITON_INTERPRET=1), "
                                                     "which has no Gluon")
    assert SM90.unavailable(Target("cuda", (8, 6), torch.bfloat16), old) == (
        "sm86 is not Hopper (the kernel needs sm90's wgmma and TMA)")
    assert "precision '8-bit' is not supported" in SM90.of("attention").unmet(
        Target("cuda", (9, 0), torch.bfloat16, 128, 64, precision="8-bit"),
        Host(frozenset({TRITON}), releases=frozenset({("triton", "3.7")})))


def test_auto_reads_the_device_and_this_process():
    """`resolve_family` without a GPU: a CUDA device object (any capability assumed) gets the sm90 kernel
    when this process's Triton is a release it is written for and not interpreted, else Triton when it is
    installed."""
    from adaptive_sparse_attention.kernels.sm90.family import TRITONS

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert registry.resolve_family("auto", cpu, torch.float32) == "torch"
    if not torch.cuda.is_available() and importlib.util.find_spec("cudnn") is None:
        host = registry.current_host()
        gluon = host.release("triton") in TRITONS and not host.interpret
        assert registry.resolve_family("auto", cuda, torch.bfloat16) == (
            ("sm90" if gluon else "triton") if HAS_TRITON else "torch")
    with pytest.raises(ValueError, match="kernel='rocm' is not allowed"):
        registry.resolve_family("rocm", cpu, torch.float32)
    assert tuple(FAMILIES) == ("cudnn", "sm90", "triton", "torch")


@pytest.mark.parametrize("target, named", [
    (Target("cuda", (9, 0), torch.float32, 128, 64), "float32"),
    (Target("cuda", (9, 0), torch.bfloat16, 32, 64), "head_dim 32"),
    (Target("cuda", (9, 0), torch.bfloat16, 128, 128), "block_size 128"),
    (Target("cuda", (8, 6), torch.bfloat16, 128, 64), "sm86 is not enabled"),
    (Target("cpu", None, torch.bfloat16, 128, 64), "cpu"),
])
def test_a_named_backend_that_cannot_run_says_why_and_runs_the_next(target, named, caplog):
    with pytest.raises(RuntimeError, match=f"kernel='cudnn' cannot run: .*{named}.*strict"):
        choose_family("cudnn", target, EVERYTHING, strict=True)
    notices = Notices()
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        for _ in range(3):
            got = choose_family("cudnn", target, EVERYTHING, notices=notices)
    assert got == ("triton" if target.device == "cuda" else "torch")
    said = [r.getMessage() for r in caplog.records if "cannot run" in r.getMessage()]
    assert len(said) == 1
    assert named in said[0]  # once per owner of the record


def test_triton_without_its_needs_falls_back_to_the_reference(caplog):
    with pytest.raises(RuntimeError, match=r"kernel='triton' cannot run: .*float64.*strict"):
        choose_family("triton", Target("cuda", (9, 0), torch.float64), EVERYTHING, strict=True)
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        assert choose_family("triton", Target("cuda", (7, 5), torch.float16), EVERYTHING, notices=Notices()) == "torch"
    assert any("sm75" in r.getMessage() and "torch reference" in r.getMessage() for r in caplog.records)


def test_a_stage_that_cannot_take_its_inputs_runs_the_reference_or_raises(caplog):
    calls = []

    def fast(x):
        calls.append("fast")
        return x + 1

    def reference(x):
        calls.append("reference")
        return x + 1

    def accepts(x):
        return None if x.dtype == torch.float32 else f"{x.dtype} is not float32"

    stage = Stage("pooled_scores", "triton", fast, reference, accepts, False, Notices())
    assert torch.equal(stage(torch.zeros(2)), torch.ones(2))
    with caplog.at_level(logging.WARNING, logger="adaptive_sparse_attention"):
        for _ in range(2):
            stage(torch.zeros(2, dtype=torch.float64))
    assert calls == ["fast", "reference", "reference"]
    assert len([r for r in caplog.records if "float64 is not float32" in r.getMessage()]) == 1
    strict = Stage("pooled_scores", "triton", fast, reference, accepts, True, Notices())
    with pytest.raises(RuntimeError, match="pooled_scores: the triton kernel cannot take these inputs.*strict"):
        strict(torch.zeros(2, dtype=torch.float64))


def test_every_stage_of_a_resolution_comes_from_its_backend():
    torch_kernels = registry.resolve("torch", torch.device("cpu"), torch.float32)
    assert torch_kernels.attention is registry.ATTENTION.of("torch").load()
    for op in registry.OPERATIONS[:-1]:
        assert getattr(torch_kernels, op.name).family == "torch"


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_every_stage_of_a_triton_resolution_is_triton(interpreter):
    """Under the interpreter fixture: resolving imports the kernel modules, which must be decorated as
    interpreted, or the interpreter tests after this one would find compiled kernels and no driver."""
    interpreted = registry.resolve("triton", torch.device("cpu"), torch.float32, host=Host(frozenset({TRITON}), interpret=True))
    assert interpreted.family == "triton"
    for op in registry.OPERATIONS[:-1]:
        assert getattr(interpreted, op.name).family == "triton"


def load_install():
    spec = importlib.util.spec_from_file_location("asa_install", Path(__file__).resolve().parents[1] / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("host", HOSTS, ids=lambda h: f"triton={h.has(TRITON)},cudnn={h.has(CUDNN)}")
def test_install_prints_what_auto_chooses(host):
    """For every GPU arch (capability), host and dtype, install.py's line names the backend `auto` takes,
    and Hopper users without the cuDNN package are told the one pip command."""
    install = load_install()
    gpus = [(f"GPU {cap}", cap) for cap in CAPABILITIES]
    lines = install.gpu_lines(registry, gpus, host)
    for i, (_, cap) in enumerate(gpus):
        line = next(line for line in lines if line.startswith(f"  cuda:{i} "))
        for dtype in registry.AUTO_DTYPES:
            want = choose_family("auto", Target("cuda", cap, dtype), host)
            assert f"{str(dtype).removeprefix('torch.')} -> {want}" in line
        tip = any(cudnn_family.INSTALL in line for line in lines[lines.index(line) + 1:][:1])
        assert tip == (cap[0] == 9 and not host.has(CUDNN))
    assert sum(cudnn_family.INSTALL in line for line in lines) == (0 if host.has(CUDNN) else 1)


def test_install_report_runs_here_and_prints_the_choice():
    lines = load_install().report()
    assert lines[0].startswith("Adaptive Sparse Attention")
    if not torch.cuda.is_available():
        assert any(line.endswith("auto runs torch") for line in lines)
    for op in registry.OPERATIONS:  # the table itself, from kernels/registry.py
        assert any(line.strip().startswith(f"{op.name} (") for line in lines)


def test_the_table_renders_every_operation():
    lines = registry.render(Target("cuda", (9, 0)), EVERYTHING)
    assert lines[0].startswith("auto: bfloat16 -> cudnn")
    for op in registry.OPERATIONS:
        assert any(line.startswith(f"{op.name} (") for line in lines)
    dense = [line for line in lines if line.startswith("dense attention (")]
    assert len(dense) == 1
    for kernel in registry.DENSE_KERNELS:  # every dense kernel a family offers, with what it needs
        assert f"{kernel.name} ({kernel.label}) [{kernel.needs}]" in dense[0]


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton, to prove it is never launched")
def test_the_torch_backend_runs_every_kernel_in_torch(monkeypatch, triton_device):
    """kernel="torch" never reaches a Triton launcher, planner included (reblock, query tail),
    even where Triton could run (on the GPU, or on the CPU with its interpreter on)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def refuse(self, *args, **kwargs):
        pytest.fail(f"Triton kernel {getattr(self, '__name__', self)} launched on the torch backend")

    monkeypatch.setattr(JITFunction, "run", refuse)
    monkeypatch.setattr(InterpretedFunction, "run", refuse)
    layout = SequenceLayout.from_segments([(0, 20, "text"), (20, 20 + 3 * 8 * 8, "video", (3, 8, 8))])
    q, k, v = (torch.randn(1, 2, layout.total, 32, generator=torch.Generator().manual_seed(i)).to(triton_device)
               for i in range(3))
    config = SparseConfig(kernel="torch", min_tokens=0)
    with pytest.raises(pytest.fail.Exception, match="launched on the torch backend"):  # the guard sees Triton
        sparse_attention(q, k, v, layout, config.replace(kernel="triton"))
    out, info = sparse_attention(q, k, v, layout, config, return_info=True)
    assert info.kernel == "torch" and isinstance(info.plan, BlockSparsePlan) and isinstance(info.plan.tail,
                                                                                               QuerySummaries)


def test_a_family_declared_outside_the_registry_resolves_by_its_place_in_the_order(monkeypatch):
    """Adding a family is a package declaring a `Family` plus its place in `FAMILIES`: here one
    declared in the test, implementing the attention only, runs it where its requirement holds;
    the planner's stages come from the families after it, and where it cannot run the next one
    does (said once)."""
    from adaptive_sparse_attention.kernels.vocabulary import Family, Implementation, Requirement

    class Attention:
        def attend_blocks(self, q, k, v, plan):
            return registry.FAMILIES["torch"].of("attention").load().attend_blocks(q, k, v, plan)

    only_cpu = Requirement("CPU only", lambda t, h: None if t.device == "cpu" else f"{t.device} is not the CPU")
    test = Family("test", (Implementation("attention", "test", Attention, (only_cpu,)),), auto="any", compiles=False)
    monkeypatch.setattr(registry, "FAMILIES", {"test": test, **registry.FAMILIES})
    cpu = registry.resolve("auto", torch.device("cpu"), torch.float64, host=Host())
    assert cpu.family == "test"
    assert isinstance(cpu.attention, Attention)
    assert all(getattr(cpu, name).family == "torch" for name, _ in registry.ROWS[:-1])
    with pytest.raises(RuntimeError, match="kernel='test' cannot run: cuda is not the CPU"):
        registry.choose_family("test", Target("cuda", (9, 0), torch.bfloat16), Host(), strict=True)
    assert registry.choose_family("test", Target("cuda", (9, 0), torch.bfloat16), Host(), notices=Notices()) == "torch"


KERNELS = "adaptive_sparse_attention.kernels"


def kernel_parts(root: Path) -> dict[str, list[tuple[str, str]]]:
    """What each part of kernels/ under `root` imports of the others, lazy imports inside functions
    included: {part: [(imported part, "file:line")]}. A part is a package (its folder's name) or a
    module at the root (its name; "__init__" is the root's face, which `from .. import name` reaches
    for a name that is no part)."""
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in root.glob("*.py")}
    files = [(p.stem, p, 1) for p in root.glob("*.py")] + [(p.parent.name, p, 2) for n in packages
                                                          for p in (root / n).glob("*.py")]
    parts: dict[str, list[tuple[str, str]]] = {part: [] for part in packages | modules}
    for part, path, up in sorted(files):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == up:  # from <root>.X import / from <root> import X
                named = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                dotted = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                named = [(d + ".__init__").split(".")[2] for d in dotted if d == KERNELS or d.startswith(KERNELS + ".")]
            else:
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            parts[part] += [(n if n in parts else "__init__", where) for n in named if n != part]
    return parts


def above(parts: dict[str, list[tuple[str, str]]], bottom: set[str]) -> set[str]:
    """The parts that import one of `bottom`, directly or through others."""
    found: set[str] = set()
    while new := {p for p, edges in parts.items() if p not in found and any(n in bottom | found for n, _ in edges)}:
        found |= new
    return found


def test_a_family_package_imports_only_the_kernels_root():
    """An implementation family's package (one with a family.py) imports no other package under kernels/,
    nor a module at the root that imports a family (the registry, the root's face): that is a circle.
    No package there imports another's family. What a kernel runs on another family's kernels is handed
    in (the cuDNN attention's pack and tail on Triton: its row borrows them and the registry loads them)
    or asked of the registry by a package above it (the sparse choice's check on the torch oracle,
    `registry.helper`). (The sparse choice keeps its choices in the dense choice's store.)"""
    root = Path(registry.__file__).parent
    parts = kernel_parts(root)
    packages = {p for p in parts if (root / p / "__init__.py").is_file()}
    families = {p for p in packages if (root / p / "family.py").is_file()}
    assert families == {"cudnn", "flash4", "reference", "sm90", "triton"}
    assert {"registry", "__init__"} <= above(parts, families)
    problems = []
    for part in sorted(packages):
        barred = (packages | above(parts, families) if part in families else families) - {part}
        problems += [f"{part}: {where} imports {n}" for n, where in parts[part] if n in barred]
    assert not problems, "\n".join(problems)
    with pytest.raises(LookupError, match="lends no helper 'nothing'"):
        registry.helper("triton", "nothing")


def test_the_kernels_import_each_other_in_no_circle():
    """Between kernels/' packages and root modules no import, lazy or not, runs back: the parts stand
    in layers (a circle would be, for one, a family asking the registry that imports it for another's
    kernels)."""
    parts = kernel_parts(Path(registry.__file__).parent)
    layered: list[str] = []
    while rest := [p for p in parts if p not in layered]:
        ready = sorted(p for p in rest if all(n in layered for n, _ in parts[p]))
        while not ready and (top := {p for p in rest if all(p != n for q in rest for n, _ in parts[q])}):
            rest = [p for p in rest if p not in top]  # what only stands above a circle, left out of the message
        circle = "\n".join(f"{p}: {where} imports {n}" for p in rest for n, where in parts[p] if n in rest)
        assert ready, f"a circle among {sorted(rest)}:\n{circle}"
        layered += ready
    assert layered.index("vocabulary") < layered.index("triton") < layered.index("registry")


def test_the_table_imports_no_kernel_module_until_a_call_resolves_to_it(tmp_path):
    """The families' rows name their kernels with ordinary imports inside `load`: importing the
    package, rendering the table and resolving the torch family import neither Triton nor a
    Triton kernel module (Triton decorates a kernel when its module is first imported)."""
    script = ("import sys, torch\n"
              "from adaptive_sparse_attention.kernels import registry as r\n"
              "r.render(r.Target('cuda', (9, 0)), r.current_host())\n"
              "r.resolve('torch', torch.device('cpu'), torch.float32)\n"
              "kernel_modules = ('attention', 'block_stats', 'block_scores', 'block_select', 'block_mass',\n"
              "                  'reblock_features', 'reblock_split', 'radix_select', 'tiled_pack')\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'\n"
              "             or m.rsplit('.', 1)[-1] in kernel_modules and '.kernels.triton.' in m))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
