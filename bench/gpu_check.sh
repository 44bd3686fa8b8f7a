#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one prepared run, for a lent GPU machine (no package index
# there): the GPU tests, the transfer and engine benchmarks, a kernel profile, then the whole
# suite with CUDA visible in the time left. Every step has a time cap and writes one log to
# $OUT (at most 8 files come back from such a machine); a step that fails does not stop the
# others, and the suite prints one line per test as it goes (-v), so a suite cut off by the
# deadline still says which tests failed.
#
#   bash bench/gpu_check.sh [quick|full]          # BUDGET=seconds (default 480) caps the whole run
#
# Python packages the machine lacks travel as wheels in .whl/ (git-ignored): see docs/gpu.md,
# "Running the GPU checks". quick: tests and transfer benches only.
set -u
MODE=${1:-full}
OUT=${OUT:-/tmp/kvtier-gpu-check}
mkdir -p "$OUT"
START=$(date +%s)
DEADLINE=$((START + ${BUDGET:-480}))

step() {   # step NAME CAP_SECONDS CMD...: runs CMD for at most CAP (and never past DEADLINE)
    local name=$1 cap=$2 left t
    shift 2
    left=$((DEADLINE - $(date +%s)))
    t=$((cap < left ? cap : left))
    if [ "$t" -lt 10 ]; then echo "## $name skipped: no time left"; return; fi
    echo "## $name (at most ${t}s, starting at $(($(date +%s) - START))s)"
    timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    echo "## $name exit $? ($(($(date +%s) - START))s)"
    tail -n "${TAILN:-20}" "$OUT/$name.log"
}

export PYTHONUNBUFFERED=1 COLUMNS=200
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvtier-torch-ext}   # one kernel build for every process
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import sys, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvtier-site .whl/*.whl \
        >/tmp/kvtier-pip.log 2>&1 || echo "installing .whl/ failed: /tmp/kvtier-pip.log"
    export PYTHONPATH=/tmp/kvtier-site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >>/tmp/kvtier-pip.log 2>&1 \
    || echo "pip install -e . failed (the C accelerators fall back to Python): /tmp/kvtier-pip.log"
TAILN=2 step build 200 python3 -c "from kvtier.transfer import kernels; print(kernels.status())"
TAILN=15 step gpu_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests
TAILN=18 step tiers_device 120 python3 -m kvtier.cli bench tiers --tier device
TAILN=14 step adapter 120 python3 -m kvtier.cli bench adapter --device cuda
[ "$MODE" = quick ] && exit 0
TAILN=18 step engine 150 sh -c "python3 -m kvtier.cli bench engine --device cuda --preset kimi-tiny && \
    python3 -m kvtier.cli bench engine --device cuda --preset kimi-small --tiers device,host --repeat 3"
TAILN=12 step engine_medium 120 python3 -m kvtier.cli bench engine --device cuda --preset kimi-medium --tiers device,host \
    --repeat 2 --prompt-tokens 2048
TAILN=12 step profile 60 ncu --clock-control none -k regex:paged_copy --launch-count 2 --section SpeedOfLight \
    python3 -m kvtier.cli bench tiers --tier device --block-bytes 64KiB --repeat 1
TAILN=25 step suite 900 sh -c "python3 -m pytest -v -n 14 --dist loadfile -p no:cacheprovider --tb=line -rfE \
    --timeout 200 | grep -v -e PASSED -e PytestBenchmarkWarning -e warner"
echo "## done in $(($(date +%s) - START))s"
