#!/usr/bin/env bash
# The test suite on a CUDA machine: the README's test command (pytest over tests/) with this machine's
# python3 and torch (no venv, no network; the package need not be installed), then every GPU test
# (`-m gpu`: tests/test_gpu_kernels.py and the GPU tests of other files) again in a fresh process,
# and a summary (date, GPU, versions, counts). Run it from the repository root before resolving an
# issue that touches kernels, and record the summary in BENCHMARKS.md:
#     bash tools/gpu_ci.sh
# Writes gpu_ci_full.log, gpu_ci_gpu.log and gpu_ci_summary.txt under $OUT (default: a new temp
# folder, printed). Exit status 0 when both runs pass, 1 when a test fails, 2 without a CUDA GPU.
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
pkg=$(mktemp -d)  # this checkout importable as adaptive_sparse_attention, ahead of any installed copy
trap 'rm -rf "$pkg"' EXIT
ln -s "$repo" "$pkg/adaptive_sparse_attention"
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}"

python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_ci.sh: torch sees no CUDA GPU')" || exit 2
cd "$repo" || exit 2
python3 -m pytest tests -q -rfE -p no:cacheprovider > "$out/gpu_ci_full.log" 2>&1; full=$?
python3 -m pytest tests -m gpu -q -rfE -p no:cacheprovider > "$out/gpu_ci_gpu.log" 2>&1; gpu=$?

counts() { grep -E '^=* ?[0-9]+ (passed|failed|skipped|error|deselected)' "$1" | tail -n 1 | tr -d '='; }
{
    echo "date:     $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "commit:   $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    python3 -c "
import platform, torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = 'not installed'
print(f'gpu:      {torch.cuda.get_device_name(0)} (sm{\"\".join(map(str, torch.cuda.get_device_capability(0)))})')
print(f'versions: python {platform.python_version()}, torch {torch.__version__}, triton {tv}')"
    echo "suite:    python3 -m pytest tests -> $(counts "$out/gpu_ci_full.log") (exit $full)"
    echo "gpu only: python3 -m pytest tests -m gpu -> $(counts "$out/gpu_ci_gpu.log") (exit $gpu)"
} | tee "$out/gpu_ci_summary.txt"
grep -hE '^(FAILED|ERROR) ' "$out/gpu_ci_full.log" "$out/gpu_ci_gpu.log" | sort -u
echo "logs: $out"
[ "$full" -eq 0 ] && [ "$gpu" -eq 0 ] || exit 1
