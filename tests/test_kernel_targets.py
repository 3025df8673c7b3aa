"""Every Triton kernel compiles for sm80/86/89/90/120 and fits its arch's shared memory.

The H200 runs only sm90 code; this compiles each kernel ahead of time for the other targets
our users run (`tools/kernel_targets.py`, in a fresh process so Triton is not in interpreter mode),
with the launch configs the launchers pick there, and checks the compiled shared memory
against the per-block limit of the arch: 99 KB on sm86/89/120 (the sm80 arch plans for
the smallest of its members), 227 KB on sm90. The kernels that gather bf16 rows must read them
in vectors: a two-byte global load means a row went element by element (what unspecialised
strides without an alignment hint compile to). The attention kernel's tiled variants (Q/K/V
packed contiguous) must read their tiles in 16-byte vectors; their two-byte loads are the int16
pick list's. The producer's epilogue reads its q, k, v rows in 16-byte vectors (its two-byte loads are
the rotation partners and the table, from lines just read). The 8-bit variants (INT8 Q.K^T, FP8 or INT8 P.V by arch) compile for every target,
and every arch's 8-bit config also as sm90 code (the H200 runs them). The sm90 family's Gluon kernel
compiles as Hopper code with at most half an SM's shared memory (two CTAs an SM), and ptxas neither
serialises its MMAs nor injects a wait into them.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SHARED_LIMIT = {"sm80": 99 * 1024, "sm90": 227 * 1024}
ROW_GATHERS = {"block_sums", "block_summaries", "gram", "gram normalised", "features", "block mass", "pack qkv",
               "quantise fp8", "quantise int8"}


@pytest.mark.slow  # compiles every kernel for every architecture target: minutes on 2 cores
def test_every_kernel_compiles_for_every_target_within_its_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "tools" / "kernel_targets.py"
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) >= 5 * 5  # five targets, five kernels each
    problems = []
    for name, r in results.items():
        arch = "sm90" if name.startswith("sm90") else "sm80"
        if "error" in r or not r["cubin"]:
            problems.append(f"{name}: {r.get('error', 'no cubin')}")
        elif r["shared"] > SHARED_LIMIT[arch]:
            problems.append(f"{name}: {r['shared']} bytes of shared memory > {SHARED_LIMIT[arch]} ({arch})")
        elif name.split(" ", 1)[1] in ROW_GATHERS and r["loads"].get("2"):
            problems.append(f"{name}: {r['loads']['2']} two-byte global loads (bf16 rows read one element at a time)")
        elif name.endswith(" tiled") and not r["loads"].get("16"):
            problems.append(f"{name}: no 16-byte global loads ({r['loads']}): packed tiles not read in vectors")
        elif name.endswith(" norm rope") and r["loads"].get("16", 0) < 6:
            problems.append(f"{name}: {r['loads']}: q, k and v rows not all read in 16-byte vectors")
    assert not problems, "\n".join(problems)
    gluon = results["sm90 exact keys gluon"]  # the sm90 family's Hopper kernel: two CTAs must share an SM
    assert gluon["shared"] <= SHARED_LIMIT["sm90"] // 2, gluon


def test_the_sm90_kernels_mmas_are_not_serialised():
    """ptxas keeps the Gluon kernel's wgmma pipeline: no MMA serialised and no wait injected (a register of an
    MMA in flight copied or read before its wait makes ptxas do either, and the overlap of the softmax with
    the MMAs is lost: the kernel's second version ran so). Compiled for sm90 without a GPU, that kernel only."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "tools" / "kernel_targets.py"
    proc = subprocess.run([sys.executable, str(script), "sm90 exact keys gluon"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gluon = json.loads(proc.stdout.strip().splitlines()[-1])["sm90 exact keys gluon"]
    assert "error" not in gluon and gluon["cubin"], gluon
    assert gluon["ptxas_notes"] == [], gluon["ptxas_notes"]
