"""First-use costs on a CUDA GPU: cold caches with and without the child compile, a new clip length, and a
model patched again in a warm process.

Three scenarios, each in its own process with an empty Triton cache (unless ``--triton-cache`` names one
kept for all) and dense-choice file (so each is a first run on a fresh machine), at H3's shapes (56 heads
of 128, 1344x768, bf16, the node's defaults):

- ``main``: the kernels compile in this process at the first clip (what a bare clone did before the
  child), then the first call, a warm call, and a second clip length (new row-width buckets).
- ``child``: `nodes/warm_start.py` starts the child compile while ``--dense-s`` seconds of real dense
  attention run (the warmup steps; the first one after the child ended prepares in this process,
  from the cache), then the first sparse step prepares beside a child still running (wait s) and stops it;
  the second clip length runs ``--dense-s2`` seconds of dense attention and prepares at its first warmup
  step when the first clip's child has ended (`WarmStart.ended_beside`), else gets a child of its own.
  With ``--load-s`` above 0, a standby child starts that many seconds before the first dense work (what
  the node's patch does while ComfyUI loads the model and encodes the prompt) and takes the first shape;
  ``--dense-s 0`` is a run without warmup steps (warmup_mode speed), where the first sparse step hands it
  the shape and prepares beside it.
- ``repatch``: a model patched again with other widgets in a warm process (the first clip prepared, every
  kernel in memory): `backend.warmup.prepare_from_memory` on new layout objects of the same shape, alone
  (with the same widgets, then with plan_reuse on), right after a standby child started (what the node's
  patch did before it learnt to skip the child in such a process; ComfyUI then runs the first call at once,
  the model and prompt being cached), once that child's imports are done (it waits for its shape), then
  alone again.

Per clip it prints: wait s (the first sparse step's preparation beside a child still running, stopping it),
preparation s (the node's `prepare_kernels` after that), first call s,
warm call s (median of 3) and first - warm, and the Triton specialisations this process built during the
preparation and the first call (Triton's compile hooks: a kernel compiled, or loaded from the disk cache, for
arguments it had not seen) with their seconds, so a first call's cost is split into compiling and the rest; per scenario the dense choice's first use (all candidates)
and, in a new chooser on the same file with a host function, the narrowed one (only the saved winner
and the host's function). Run from the repository root with the package importable:

    python tools/first_call_timing.py                 # about 2 minutes on an H200
    python tools/first_call_timing.py --json out.json
    python tools/first_call_timing.py --scenarios repatch   # about a minute
    python tools/first_call_timing.py --scenarios main,main,child --triton-cache /tmp/tc --load-s 10 --dense-s 3.2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

CLIPS = "72:810,67:754"  # latent frames:audio tokens; 10 s (243 frames), then 226 frames (another row bucket)


def synced(fn) -> float:
    """Seconds of fn() with the GPU synchronised before and after."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


@contextmanager
def built_kernels():
    """The Triton specialisations this process builds inside the block: a list of (kernel, seconds),
    from Triton's jit_cache_hook (before a build) and jit_post_compile_hook (after it); None where this
    Triton has no such hooks (before 3.4)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        yield None
        return
    built, started = [], {}

    def before(*, key, fn, **_):
        started[str(key)] = time.perf_counter()
        return False  # build it: this only records

    def after(*, key, fn, **_):
        built.append((fn.name, time.perf_counter() - started.pop(str(key), time.perf_counter())))

    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    try:
        yield built
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def dense_for(seconds: float, q, k, v, warmup_step=None) -> int:
    """Run dense attention (a warmup step's work) for about `seconds`, calling `warmup_step()` after each
    call as the node's block hook does; returns the calls made."""
    import torch

    end, calls = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
        torch.cuda.synchronize()
        calls += 1
        if warmup_step is not None:
            warmup_step()
    return calls


def clip_layout(spec: str):
    from adaptive_sparse_attention import SequenceLayout

    frames, audio = (int(x) for x in spec.split(":"))
    text, video = 256, frames * 24 * 42
    return SequenceLayout.from_segments([(0, text, "text"), (text, text + audio, "audio"),
                                         (text + audio, text + audio + video, "video", (frames, 24, 42))])


def scenario(name: str, clips: list[str], dense_s: float, dense_s2: float, kernel: str, load_s: float = 0.0) -> dict:
    """One scenario in this process (its caches are empty: the parent set them)."""
    import torch

    from adaptive_sparse_attention import SparseConfig, sparse_attention
    from adaptive_sparse_attention.backend.warmup import prepare_kernels
    from adaptive_sparse_attention.kernels.dense.choice import DenseChoices, HostAttention
    from adaptive_sparse_attention.nodes.warm_start import (WarmStart, job_key, standby_for, start_during_warmup,
                                                             take_over_before_sparse)

    device, dtype, heads, dim = torch.device("cuda"), torch.bfloat16, 56, 128
    config = SparseConfig(precision="bf16", kernel=kernel)
    warm = WarmStart()
    result = {"scenario": name, "clips": []}
    for i, clip in enumerate(clips):
        layout = clip_layout(clip)
        g = torch.Generator(device).manual_seed(i)
        q, k, v = (torch.randn(1, heads, layout.total, dim, generator=g, device=device, dtype=dtype) for _ in range(3))
        row = {"clip": clip, "tokens": layout.total, "wait_s": None, "dense_calls": 0, "warmup_prepare_s": None}
        if name == "child":
            def warmup_step() -> None:  # what SparseAttentionHook.prepare does at a warmup step
                job = warm.jobs.get(key)
                if job is not None and row["child_up_s"] is None and job.up():
                    row["child_up_s"] = time.perf_counter() - job.started  # its imports done, to a dense call
                if row["warmup_prepare_s"] is None and not start_during_warmup(warm, layout, config, dtype, device,
                                                                               dim, heads):
                    row["warmup_prepare_s"] = synced(lambda: prepare_kernels(layout, config, dtype, device, dim, heads))

            key = job_key(layout, config, dtype, device, dim, heads)
            row["child_up_s"] = None
            if i == 0 and load_s > 0:  # the node's patch, then ComfyUI's model load and text encoding
                row["standby"] = standby_for(warm, device, config)
                time.sleep(load_s)
            seconds, row["child"] = (dense_s if i == 0 else dense_s2), False
            if seconds > 0:  # 0: no warmup steps (warmup_mode speed): the first sparse step hands the child the shape
                row["child"] = start_during_warmup(warm, layout, config, dtype, device, dim, heads)
                row["dense_calls"] = dense_for(seconds, q, k, v, warmup_step)
            job = warm.jobs.get(key)
            if job is not None:
                job.poll()
                row["child_s"] = None if job.ended is None else job.ended - job.started  # None: still running
                row["child_output"] = job.text()[-2000:]
            row["wait_s"] = synced(lambda: take_over_before_sparse(warm, layout, config, dtype, device, dim, heads))
        with built_kernels() as built:
            row["prepare_s"] = synced(lambda: prepare_kernels(layout, config, dtype, device, dim, heads))
            row["first_s"] = synced(lambda: sparse_attention(q, k, v, layout, config))
        row["built"] = built
        row["warm_s"] = statistics.median(synced(lambda: sparse_attention(q, k, v, layout, config)) for _ in range(3))
        if i == 0:
            path = Path(os.environ["ADAPTIVE_SPARSE_DENSE_CACHE"])
            sample = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
            result["dense_first_use_s"] = synced(lambda: DenseChoices(path).choice(*sample))
            host = HostAttention("tools.first_call_timing.sdpa", torch.nn.functional.scaled_dot_product_attention,
                                 label="a stand-in host function (SDPA)")
            result["dense_narrowed_s"] = synced(lambda: DenseChoices(path).choice(*sample, host))
        del q, k, v
        result["clips"].append(row)
    warm.close()
    return result


def repatch(clip: str, kernel: str) -> dict:
    """The ``repatch`` scenario in this process: seconds of `prepare_from_memory` per case (module docstring)."""
    import torch

    from adaptive_sparse_attention import SparseConfig
    from adaptive_sparse_attention.backend.warmup import prepare_from_memory, prepare_kernels
    from adaptive_sparse_attention.nodes.warm_start import STANDBY_KEY, STANDBY_LINE, WarmStart

    device, dtype, heads, dim = torch.device("cuda"), torch.bfloat16, 56, 128
    config = SparseConfig(precision="bf16", kernel=kernel)
    result = {"scenario": "repatch", "clips": [], "tokens": clip_layout(clip).total,
              "first_prepare_s": synced(lambda: prepare_kernels(clip_layout(clip), config, dtype, device, dim, heads)),
              "cases": []}
    cases = (("alone", config), ("alone, plan_reuse on", config.replace(plan_reuse="on")),
             ("standby starting", config), ("standby up", config), ("alone again", config))
    for case, widgets in cases:
        warm, up_s = WarmStart(), None
        if case.startswith("standby") and warm.standby():  # the child itself: the node's `standby_for` no longer
            # starts one where the process holds the kernels, as here
            start = time.perf_counter()
            while (case == "standby up" and STANDBY_LINE not in warm.jobs[STANDBY_KEY].text()
                   and time.perf_counter() - start < 60):
                time.sleep(0.05)
            up_s = time.perf_counter() - start
        done: list = []
        seconds = synced(lambda: done.append(prepare_from_memory(clip_layout(clip), widgets, dtype, device, dim, heads)))
        warm.close()
        result["cases"].append({"case": case, "from_memory_s": seconds, "in_memory": done[0] is not None,
                                "standby_waited_s": up_s})
    return result


def table(results: list[dict]) -> str:
    lines = ["| scenario | clip | tokens | child | dense calls | prepared in warmup s | wait s | prepare s | "
             "first call s | warm call s | first - warm s | kernels built (s) | child up s | child done s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for c in r["clips"]:
            wait = "-" if c["wait_s"] is None else f"{c['wait_s']:.2f}"
            during = "-" if c["warmup_prepare_s"] is None else f"{c['warmup_prepare_s']:.2f}"
            lines.append(f"| {r['scenario']} | {c['clip']} | {c['tokens']} | {c.get('child', '-')} | {c['dense_calls']} "
                         f"| {during} | {wait} | {c['prepare_s']:.2f} | {c['first_s']:.3f} | {c['warm_s']:.3f} | "
                         f"{c['first_s'] - c['warm_s'] + c['prepare_s']:.2f} | " +
                         ("not recorded" if c["built"] is None else
                          f"{len(c['built'])} ({sum(t for _, t in c['built']):.2f})") + " | " +
                         " | ".join("-" if c.get(f) is None else f"{c[f]:.1f}" for f in ("child_up_s", "child_s")) + " |")
    lines.append("")
    lines.append("wait s is the first sparse step's preparation beside a child still running (then stopped); prepare "
                 "s the node's preparation after it (near 0 when a warmup step or that one prepared already); first - "
                 "warm s counts it too: what the first sparse call of that clip costs over a warm one, apart from the "
                 "wait. Dense choice, first use of a bucket: " + "; ".join(
                     f"{r['scenario']}: all candidates {r['dense_first_use_s']:.2f} s, narrowed with a host function "
                     f"{r['dense_narrowed_s']:.2f} s" for r in results if "dense_first_use_s" in r))
    for r in results:
        for c in r.get("cases", ()):
            waited = "" if c["standby_waited_s"] is None else f" (the standby child started {c['standby_waited_s']:.1f} s before)"
            lines.append(f"repatch at {r['tokens']} tokens, kernels in memory (first preparation "
                         f"{r['first_prepare_s']:.2f} s): {c['case']}: " + ("prepared from memory" if c["in_memory"] else
                                                                 "NOT all in memory, stopped") +
                         f" in {c['from_memory_s']:.2f} s{waited}")
        for c in r["clips"]:
            if c["built"]:
                lines.append(f"kernels built, {r['scenario']} {c['clip']}: " +
                             ", ".join(f"{name} {t:.2f} s" for name, t in c["built"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clips", default=CLIPS, help=f"latent frames:audio tokens per clip, in order (default {CLIPS})")
    p.add_argument("--dense-s", type=float, default=20.0, help="dense work while the first clip's child runs (s)")
    p.add_argument("--dense-s2", type=float, default=6.0, help="dense work while the second clip's child runs (s)")
    p.add_argument("--load-s", type=float, default=0.0, help="a standby child starts this long before the first "
                                                              "clip's dense work (0: none)")
    p.add_argument("--scenarios", default="main,child", help="main, child and repatch (default main,child)")
    p.add_argument("--kernel", default="auto", help="the node's kernel setting (auto: cuDNN-frontend where installed "
                                                     "on Hopper, else Triton)")
    p.add_argument("--triton-cache", help="one Triton cache folder for every scenario, kept (default: an empty one "
                                          "each): `--scenarios main,main,child` then times a first run on a warm "
                                          "disk cache without and with the child")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one scenario in this process (the parent's child)
    args = p.parse_args(argv)
    clips = args.clips.split(",")
    if args.one:
        result = (repatch(clips[0], args.kernel) if args.one == "repatch" else
                  scenario(args.one, clips, args.dense_s, args.dense_s2, args.kernel, args.load_s))
        print(json.dumps(result), flush=True)
        return 0
    results = []
    for name in args.scenarios.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, TRITON_CACHE_DIR=args.triton_cache or str(Path(tmp) / "triton"),
                       ADAPTIVE_SPARSE_DENSE_CACHE=str(Path(tmp) / "dense.json"))
            start = time.perf_counter()
            out = subprocess.run([sys.executable, __file__, "--one", name, "--clips", args.clips, "--dense-s",
                                  str(args.dense_s), "--dense-s2", str(args.dense_s2), "--kernel", args.kernel,
                                  "--load-s", str(args.load_s)], env=env, capture_output=True,
                                 text=True)
            if out.returncode != 0:
                print(out.stdout + out.stderr[-4000:])
                return out.returncode
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{name}: {time.perf_counter() - start:.0f} s in all", flush=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
