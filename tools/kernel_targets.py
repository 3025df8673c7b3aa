"""Compile every Triton kernel of the package for NVIDIA targets on this machine (no GPU needed).

Run as a script in a fresh process (Triton must not be in interpreter mode when the kernels are
imported); the compiles run in a pool of one process per core. Prints one JSON object: for every
(kernel, target), the shared memory the compiled kernel uses, whether a cubin came out and its global
loads by width, or the compile error.
Argument types and specialisations mirror what Triton gives the launches at the H3 shapes: bf16
tensors, int32 tables, unit innermost strides (constants), 16-divisible pointers, strides, head
dim and feature rank, except the arguments a kernel leaves unspecialised (`do_not_specialize`,
`do_not_specialize_on_alignment`), which get no divisibility, as at run time.
"""
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from adaptive_sparse_attention.kernels.triton import (block_mass, block_quantise, block_scores, block_select, block_stats,
                                                      norm_rope, reblock_features, reblock_split, tiled_pack)
from adaptive_sparse_attention.kernels.triton import attention as triton_attention
from adaptive_sparse_attention.kernels.arch import (CONFIGS, EIGHT_BIT_ARCHS, EIGHT_BIT_CONFIGS, PV_FORMATS, arch_of,
                                                    eight_bit_arch)
from adaptive_sparse_attention.kernels.triton.configs import FINISH_CONFIGS

TARGETS = (80, 86, 89, 90, 120)  # Ampere, Ampere consumer, Ada, Hopper, consumer Blackwell
UNIT_STRIDES = {"sq_d", "sk_d", "sv_d", "so_d", "sl_s", "sx_d"}
ALIGNED_SIZES = {"D", "r"}  # head dim 128 and feature rank 16 at the H3 shapes


def global_load_widths(ptx: str) -> dict[str, int]:
    """Global loads of a PTX listing by bytes per load (vector width x element size), cp.async included."""
    counts: dict[str, int] = {}
    for mods in re.findall(r"\bld\.global((?:\.[\w:]+)*)", ptx):
        vec = next((int(m[1:]) for m in mods.split(".") if re.fullmatch(r"v\d", m)), 1)
        bits = next((int(m[1:]) for m in mods.split(".") if re.fullmatch(r"[bfsu]\d+", m)), 0)
        counts[str(vec * bits // 8)] = counts.get(str(vec * bits // 8), 0) + 1
    for size in re.findall(r"cp\.async\.\w+\.shared(?:::cta)?\.global[^;]*?,\s*(0x[0-9a-f]+|\d+)\s*[,;]", ptx):
        counts[str(int(size, 0))] = counts.get(str(int(size, 0)), 0) + 1
    return counts


def compile_for(fn, pointers: dict, floats: set, const: dict, capability: int, warps: int, stages: int) -> dict:
    const = dict(const, **{n: 1 for n in fn.arg_names if n in UNIT_STRIDES})
    sig = {n: pointers.get(n) or ("constexpr" if n in const else "fp32" if n in floats else "i32") for n in fn.arg_names}
    kept = {p.name for p in fn.params if not p.do_not_specialize}
    kept_aligned = {p.name for p in fn.params if not p.do_not_specialize_on_alignment}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if n in kept and (n in pointers and n in kept_aligned
                                 or sig[n] == "i32" and (n in ALIGNED_SIZES or n.startswith("s") and "_" in n))}
    try:
        k = triton.compile(ASTSource(fn, signature=sig, constexprs=const, attrs=aligned),
                           target=GPUTarget("cuda", capability, 32), options={"num_warps": warps, "num_stages": stages})
    except Exception as e:  # reported, so the test names the kernel and target that failed
        return {"error": repr(e)[-600:]}
    return {"shared": k.metadata.shared, "cubin": "cubin" in k.asm, "loads": global_load_widths(k.asm["ptx"])}


def attention(capability: int, head_dim: int, query_tail: bool, finish: bool = False, tiled: bool = False,
              eight_bit: str | None = None) -> dict:
    """The attention kernel with the launcher's config, reading the exact keys as row gathers or
    (tiled) from packed Q/K/V, or (finish) the variant that adds the tail to a partial result, with
    the config its launcher picks; `eight_bit`: the 8-bit variant with that arch's config
    (`EIGHT_BIT_CONFIGS`: its P.V format and tiles)."""
    arch = arch_of((capability // 10, capability % 10))
    cfg = FINISH_CONFIGS.get((arch, head_dim, 64), CONFIGS[(arch, head_dim, 64)]) if finish else \
        CONFIGS[(arch, head_dim, 64)]
    if eight_bit:
        cfg = EIGHT_BIT_CONFIGS[(eight_bit, head_dim, 64)]
    fp8 = eight_bit is not None and cfg.pv == "fp8"
    pointers = {n: "*bf16" for n in ("Q", "K", "V", "Out", "TailK", "TailV")}
    pointers.update({n: "*fp32" for n in ("Lse", "TailBias", "BlockLogit", "BlockValue", "PartLse",
                                          "QS", "QShift", "KS", "VS")})
    pointers.update(PartOut="*bf16", QC="*i8", KC="*i8", VC="*fp8e4nv" if fp8 else "*i8")
    pointers.update({n: "*i32" for n in ("QPerm", "KPerm", "BlockLen", "DenseHi", "Q2kNum")}, Q2kIdx="*i16")
    const = dict(BS=64, HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_T=cfg.block_t,
                 QUERY_TAIL=query_tail, BLOCK_TAIL=not query_tail, FROM_PARTIAL=finish, TILED=tiled, DOT_DTYPE=tl.bfloat16,
                 PRECISION="tf32", EMPTY_LSE=-1.0e30, ROW_DTYPE=tl.int32, EIGHT_BIT=eight_bit is not None,
                 PV_FP8=fp8, EMULATE_FP8=False)
    return compile_for(triton_attention._block_sparse_fwd, pointers, {"qk_scale"}, const, capability,
                       cfg.num_warps, cfg.num_stages)


def quantise_pass(capability: int, pv: str) -> dict:
    """The 8-bit pre-pass (`block_quantise`) at block size 64, head_dim 128, P.V format `pv`."""
    pointers = {n: "*bf16" for n in ("Q", "K", "V")} | {"QPerm": "*i32", "KPerm": "*i32"}
    pointers |= {n: "*fp32" for n in ("Mean", "VMax", "QS", "QShift", "KS", "VS")}
    pointers |= {"QC": "*i8", "KC": "*i8", "VC": "*fp8e4nv" if pv == "fp8" else "*i8"}
    return compile_for(block_quantise._quantise_blocks, pointers, set(),
                       {"BS": 64, "HEAD_DIM": 128, "LOG_D": 7, "PV_FP8": pv == "fp8", "EMULATE_FP8": False, "ALIGN": 8},
                       capability, 8, 1)


def planner(capability: int) -> dict:
    stats = dict(BS=64, BLOCK_S=64, BLOCK_D=128, ALIGN=8)  # ALIGN: bf16 rows of H3 buffers, as the launchers find
    return {
        "block_sums": compile_for(block_stats._block_sums, {"X": "*bf16", "Perm": "*i32", "BlockLen": "*i32",
                                                            "Out": "*fp32"}, set(), stats, capability, 2, 3),
        "block_summaries": compile_for(
            block_stats._block_summaries, {"K": "*bf16", "V": "*bf16", "Perm": "*i32", "BlockLen": "*i32",
                                           "Anchor": "*fp32", "Key": "*bf16", "Value": "*bf16", "Bias": "*fp32"},
            {"scale"}, dict(stats, REWEIGHT=True), capability, 2, 3),
        "scores": compile_for(block_scores._pooled_scores, {"Q": "*fp32", "K": "*fp32", "Out": "*fp32"}, {"scale"},
                              {"DP": 128, "TILE": block_scores.TILE, "PRECISION": "tf32x3"}, capability, 4, 3),
        **{f"scores {fmt}": compile_for(
            block_scores._quantised_scores, {"Q": code, "K": code, "QScale": "*fp32", "KScale": "*fp32", "Out": "*fp32"},
            set(), {"DP": 128, "TILE": block_scores.TILE, "INT8": fmt == "int8"}, capability, 4, 3)
           for fmt, code in (("int8", "*i8"), ("fp8", "*fp8e4nv")) if fmt == "int8" or capability >= 89},
        **{f"select {head}+{tail}": compile_for(
            block_select._select_group, {"Scores": "*fp32", "DenseHi": "*i32", "Out": "*i16"}, set(),
            {"HEAD": head, "TAIL": tail}, capability, max(1, head // 1024), 3) for head, tail in ((2048, 1), (1024, 128))},
        **{f"gram{' normalised' * norm}": compile_for(
            reblock_features._gram, {"A": "*bf16", "L": "*bf16", "Out": "*fp32"}, set(),
            {"DP": 128, "BLOCK": reblock_features.GRAM_ROWS, "SPLITS": reblock_features.SPLITS, "NORMALISE": norm,
             "PRECISION": "tf32", "ALIGN": 8}, capability, 8, 3) for norm in (False, True)},
        **{f"top share {head}+{tail}": compile_for(
            block_mass._top_share, {"LogMass": "*fp32", "Out": "*fp32"}, set(), {"HEAD": head, "TAIL": tail},
            capability, max(1, head // 1024), 3) for head, tail in ((2048, 1), (1024, 128))},
        "features": compile_for(reblock_features._metric_project, {"X": "*bf16", "L": "*bf16", "P": "*bf16",
                                                                   "Out": "*fp16"}, set(),
                                {"R": 16, "DP": 128, "BLOCK": reblock_features.BLOCK_M, "TILES": reblock_features.TILES,
                                 "PRECISION": "tf32", "ALIGN": 8}, capability, 4, 3),
        "block mass": compile_for(block_mass._block_log_mass, {"Q": "*bf16", "K": "*bf16", "Perm": "*i32", "Out": "*fp32"},
                                  {"scale"}, {"P": 64, "DP": 128, "BS": 64, "BLOCKS": block_mass.BLOCKS,
                                              "PRECISION": "tf32", "ALIGN": 8}, capability, 4, 3),
        **{f"directions M{mp}": compile_for(
            reblock_split._split_directions, {"Z": "*fp16", "Rows": "*i32", "Landmarks": "*i64", "Out": "*fp32"}, set(),
            {"RP": 16, "MP": mp, "CH": min(mp, 64), "SQUARINGS": 4, "STEPS": 3}, capability, max(1, min(8, mp // 256)), 3)
           for mp in (32, 2048)},
        "node keys": compile_for(reblock_split._node_keys, {"Z": "*fp16", "Dir": "*fp32", "Rows": "*i32", "Tokens": "*i32",
                                                            "Keys": "*i32"}, set(),
                                 {"BLOCK": reblock_split.KEY_BLOCK, "R": 16}, capability, 4, 3),
        **{f"split {'wide' if wide else 'narrow'}": compile_for(
            reblock_split._split_level, {"Z": "*fp16", "Dir": "*fp32", "Rows": "*i32", "Tokens": "*i32",
                                         "Left": "*i32", "Keys": "*i32", "Cand": "*i32", "RowsOut": "*i32"},
            set(), {"R": 16, "BLOCK": reblock_split.CHUNK, "WIDE": wide, "SAMPLE": reblock_split.SAMPLE,
                    "MARGIN": reblock_split.MARGIN, "CAP": reblock_split.CAP}, capability, 8, 3) for wide in (False, True)},
    }


def pack_qkv(capability: int) -> dict:
    return compile_for(tiled_pack._pack_qkv, {n: "*bf16" for n in ("Q", "K", "V", "QT", "KT", "VT")}
                       | {"QPerm": "*i32", "KPerm": "*i32"}, set(),
                       {"HEAD_DIM": 128, "BLOCK": tiled_pack.SLOTS, "ALIGN": 8}, capability, 4, 3)


def norm_rope_pass(capability: int) -> dict:
    return compile_for(norm_rope._norm_rope, {n: "*bf16" for n in ("C", "Q", "K", "V", "T", "QScale", "KScale")},
                       {"eps"}, {"HEAD_DIM": 128, "BLOCK_ROWS": norm_rope.ROWS, "ROPE": True}, capability, 4, 3)


def sm90_exact_keys(capability: int) -> dict:
    """The sm90 family's Gluon kernel of the exact keys (head dim 128, bf16, its launcher's default rings and
    register cap): Hopper code only."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource

    from adaptive_sparse_attention.kernels.sm90 import attention as sm90

    desc = f"tensordesc<bf16[{sm90.BLOCK}, 128],{sm90.shared_layout(128, torch.bfloat16)!r}>"
    fn = sm90._exact_keys_sm90
    sig = dict(q_desc=desc, k_desc=desc, v_desc=desc, PartOut="*bf16", PartLse="*fp32", BlockLen="*i32",
               DenseHi="*i32", Q2kIdx="*i16", Q2kNum="*i32", qk_scale="fp32", K_STAGES="constexpr",
               V_STAGES="constexpr")
    sig = {n: sig.get(n, "i32") for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    k_stages, v_stages = sm90.STAGES
    try:
        k = triton.compile(GluonASTSource(fn, signature=sig, constexprs={"K_STAGES": k_stages, "V_STAGES": v_stages},
                                          attrs=aligned), target=GPUTarget("cuda", capability, 32),
                           options={"num_warps": 4, "maxnreg": sm90.MAXNREG})
    except Exception as e:  # reported, so the test names the kernel and target that failed
        return {"error": repr(e)[-600:]}
    return {"shared": k.metadata.shared, "cubin": "cubin" in k.asm, "loads": global_load_widths(k.asm["ptx"]),
            "ptxas_notes": ptxas_notes(k.asm["ptx"], capability)}


def ptxas_notes(ptx: str, capability: int) -> list[str]:
    """What Triton's ptxas says of `ptx` about its wgmma pipeline: the "Potential Performance Loss" notes
    (wgmma serialised) and waits it injected (a register of an MMA in flight used too early), which its own
    compile does not report."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        proc = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name=sm_{capability}a", path, "-o",
                               os.path.join(tmp, "kernel.o")], capture_output=True, text=True, timeout=300)
    return [line.strip() for line in (proc.stderr + proc.stdout).splitlines()
            if "Performance Loss" in line or "is injected" in line or "error" in line.lower()]


def jobs() -> list[tuple]:
    """Every compile as (row name, function, args, kwargs); `planner` returns several rows, named under its own."""
    out = []
    for cap in TARGETS:
        arch8 = eight_bit_arch((cap // 10, cap % 10))
        out += [(f"sm{cap} attention D128 query", attention, (cap, 128, True), {}),
                (f"sm{cap} attention D128 query tiled", attention, (cap, 128, True), {"tiled": True}),
                (f"sm{cap} attention D128 query 8-bit", attention, (cap, 128, True), {"eight_bit": arch8}),
                (f"sm{cap} quantise {PV_FORMATS[arch8]}", quantise_pass, (cap, PV_FORMATS[arch8]), {}),
                (f"sm{cap} norm rope", norm_rope_pass, (cap,), {}),
                (f"sm{cap}", planner, (cap,), {})]
    for tiled in (False, True):
        mode = " tiled" * tiled
        out += [(f"sm86 attention D128 block{mode}", attention, (86, 128, False), {"tiled": tiled}),
                (f"sm90 attention D128 block{mode}", attention, (90, 128, False), {"tiled": tiled}),
                (f"sm86 attention D64 query{mode}", attention, (86, 64, True), {"tiled": tiled}),
                (f"sm86 attention D32 block{mode}", attention, (86, 32, False), {"tiled": tiled})]
    out.append(("sm90 attention D128 query finish", attention, (90, 128, True), {"finish": True}))
    for arch8 in EIGHT_BIT_ARCHS:  # every arch's 8-bit config as Hopper code: what the H200 can run
        out.append((f"sm90 attention D128 block 8-bit {arch8} config", attention, (90, 128, False), {"eight_bit": arch8}))
    out.append(("sm90 pack qkv", pack_qkv, (90,), {}))
    out.append(("sm90 exact keys gluon", sm90_exact_keys, (90,), {}))
    return out


def run(job: tuple) -> dict:
    """One job's rows."""
    name, fn, args, kwargs = job
    result = fn(*args, **kwargs)
    return {f"{name} {row}": r for row, r in result.items()} if fn is planner else {name: result}


if __name__ == "__main__":
    # the compiles are independent and CPU-bound: one process per core (the rows keep the jobs' order);
    # arguments, if any, keep only the jobs whose names start with one of them
    todo = [j for j in jobs() if len(sys.argv) < 2 or any(j[0].startswith(a) for a in sys.argv[1:])]
    with ProcessPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1)) as pool:
        print(json.dumps({name: r for rows in pool.map(run, todo) for name, r in rows.items()}))
