"""The kernel check's tables as markdown: kernel and whole-call rows per shape, then the cuDNN rows."""
from __future__ import annotations


def markdown(results: dict) -> str:
    """The markdown tables of `results` (what kernel_check.md holds)."""
    lines = [f"# Kernel check on {results['device']} ({results['versions']})", "",
             "| shape | block | ratio | tail | arch | kernel ms | TFLOP/s (pairs computed) | % dense rate | "
             "% dense time | whole op ms | whole op % dense |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in results.get("timing", {}).items():
        lines.append(f"| {name} dense cuDNN | | | | | {e['dense_cudnn_ms']:.1f} | "
                     f"{e['dense_cudnn_tflops']:.0f} | 100 | 100 | | |")
        for r in e["rows"]:
            whole = (f"{r['sparse_attention_ms']:.1f} | {100 * r['sparse_attention_vs_dense']:.1f}"
                     if "sparse_attention_ms" in r else " | ")
            lines.append(f"| {name} | {r['block_size']} | {r['ratio']} | {r['gran']} | {r['arch']} | "
                         f"{r['kernel_ms']:.2f} | {r['tflops']:.0f} | {100 * r['vs_dense_rate']:.0f} | "
                         f"{100 * r['vs_dense_time']:.1f} | {whole} |")
    cudnn = [(name, r) for name, e in results.get("timing", {}).items() for r in e.get("cudnn", [])]
    if cudnn:
        lines += ["", "| shape | ratio | tail | anchor ms | anchor TFLOP/s | anchor % dense rate | anchor on the default "
                  "tiling ms / % dense rate | cudnn backend ms | "
                  "whole op (default tiling) cudnn / triton ms | plan device ms | plan % of op cudnn / triton |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in cudnn:
            lines.append(f"| {name} | {r['ratio']} | {r['gran']} | {r['anchor_ms']:.2f} | {r['anchor_tflops']:.0f} | "
                         f"{100 * r['anchor_vs_dense_rate']:.0f} | {r['anchor_default_tiling_ms']:.2f} / "
                         f"{100 * r['anchor_default_tiling_vs_dense_rate']:.0f} | {r['cudnn_backend_ms']:.2f} | "
                         f"{r['op_default_cudnn_ms']:.1f} / {r['op_default_triton_ms']:.1f} | "
                         f"{r['plan_default_cudnn_ms']:.1f} | {100 * r['plan_share_cudnn']:.1f} / "
                         f"{100 * r['plan_share_triton']:.1f} |")
    return "\n".join(lines) + "\n"
