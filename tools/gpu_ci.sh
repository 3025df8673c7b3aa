#!/usr/bin/env bash
# The test suite on a CUDA machine: the README's test command (pytest over tests/) with this machine's
# python3 and torch (no venv, no network; the package need not be installed), then every GPU test
# (`-m gpu`: tests/test_gpu_kernels.py and the GPU tests of other files) again in a fresh process,
# and a summary (date, GPU, versions, counts). Run it from the repository root before resolving an
# issue that touches kernels, and record the summary in BENCHMARKS.md:
#     bash tools/gpu_ci.sh              # both runs
#     bash tools/gpu_ci.sh suite        # or one of them: suite, gpu
#     bash tools/gpu_ci.sh half1 half2  # the suite's test files in two halves (sorted by name), one per call
# Writes gpu_ci_<run>.log (with the 25 slowest tests) and gpu_ci_summary.txt under $OUT (default: a new temp
# folder, printed). The suite alone nearly fills a 10-minute device call (BENCHMARKS.md, "The test suite on
# the H200"): give it a call of its own, or run half1 and half2 in two calls.
# Exit status 0 when every run passes, 1 when a test fails, 2 without a CUDA GPU or on a bad argument.
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
pkg=$(mktemp -d)  # this checkout importable as adaptive_sparse_attention, ahead of any installed copy
trap 'rm -rf "$pkg"' EXIT
ln -s "$repo" "$pkg/adaptive_sparse_attention"
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}"

runs=${*:-suite gpu}
for run in $runs; do
    case $run in suite|gpu|half1|half2) ;; *) echo "gpu_ci.sh: run '$run' is not allowed: expected suite, gpu, half1 or half2" >&2; exit 2;; esac
done
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_ci.sh: torch sees no CUDA GPU')" || exit 2
cd "$repo" || exit 2
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
} | tee "$out/gpu_ci_summary.txt"
status=0
for run in $runs; do
    files=(tests/test_*.py); half=$(( (${#files[@]} + 1) / 2 ))
    case $run in
        suite) args=(tests) ;;
        gpu) args=(tests -m gpu) ;;
        half1) args=("${files[@]:0:$half}") ;;
        half2) args=("${files[@]:$half}") ;;
    esac
    python3 -m pytest "${args[@]}" -q -rfE --durations=25 -p no:cacheprovider > "$out/gpu_ci_$run.log" 2>&1; rc=$?
    counts=$(grep -E '^=* ?[0-9]+ (passed|failed|skipped|error|deselected)' "$out/gpu_ci_$run.log" | tail -n 1 | tr -d '=')
    shown=${args[*]}; [ "${run#half}" = "$run" ] || shown="${args[0]} .. ${args[-1]} (${#args[@]} files)"
    printf '%-9s python3 -m pytest %s -> %s (exit %d)\n' "$run:" "$shown" "$counts" "$rc" | tee -a "$out/gpu_ci_summary.txt"
    grep -E '^(FAILED|ERROR) ' "$out/gpu_ci_$run.log"
    [ "$rc" -eq 0 ] || status=1
done
echo "logs: $out"
exit $status
