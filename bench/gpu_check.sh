#!/usr/bin/env bash
# The GPU checks of docs/gpu.md as prepared, time-capped runs for a lent GPU machine (no
# package index there): the GPU tests, the transfer and engine benchmarks, then the whole
# suite with CUDA visible. Every step has a time cap and writes one log to $OUT (at most 8
# files come back from such a machine); a step that fails does not stop the others, and the
# suite prints one line per test as it goes (-v), so a suite cut off by the deadline still
# says which tests failed.
#
#   bash bench/gpu_check.sh [checks|suite|full|quick]     # BUDGET=seconds (default 480) caps the run
#
# checks: GPU tests and benchmarks; suite: the rest of the suite (-m "not gpu") with CUDA
# visible, meant as a second call on the same warm machine (the installs and the kernel build
# are kept); full: both; quick: GPU tests and the transfer benches only.
# Python packages the machine lacks travel as wheels in .whl/ (git-ignored): see docs/gpu.md,
# "Running it on a GPU machine".
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
    # SIGABRT at the cap: Python's faulthandler then prints every thread's stack to the log
    # (a step that ran out of time says where it was: working, or stuck on the way out)
    timeout -s ABRT -k 10 "$t" "$@" >"$OUT/$name.log" 2>&1
    echo "## $name exit $? ($(($(date +%s) - START))s; its last output at $(($(stat -c %Y "$OUT/$name.log") - START))s)"
    tail -n "${TAILN:-20}" "$OUT/$name.log"
}

export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 COLUMNS=200 MAX_JOBS=16
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvtier-torch-ext}   # one kernel build for every process
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
[ -d /tmp/kvtier-site ] && export PYTHONPATH=/tmp/kvtier-site
if ! python3 -c "import lmdb, kvtier._copy" >/dev/null 2>&1; then   # a warm machine keeps both
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import sys, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvtier-site .whl/*.whl \
            >/tmp/kvtier-pip.log 2>&1 || echo "installing .whl/ failed: /tmp/kvtier-pip.log"
        export PYTHONPATH=/tmp/kvtier-site
    fi
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >>/tmp/kvtier-pip.log 2>&1 \
        || echo "pip install -e . failed (the C accelerators fall back to Python): /tmp/kvtier-pip.log"
fi
TAILN=2 step build 200 python3 -c "from kvtier.transfer import kernels; kernels.load(); print(kernels.status())"
if [ "$MODE" != suite ]; then
    TAILN=12 step gpu_tests 170 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --timeout 150 tests
    if [ "$MODE" = quick ]; then
        TAILN=18 step tiers_device 120 python3 -m kvtier.cli bench tiers --tier device
        TAILN=14 step adapter 120 python3 -m kvtier.cli bench adapter --device cuda
        exit 0
    fi
    TAILN=26 step engine 150 sh -c "python3 -m kvtier.cli bench engine --device cuda --preset kimi-tiny && \
        python3 -m kvtier.cli bench engine --device cuda --preset kimi-small --tiers device,host --repeat 3"
    TAILN=16 step engine_medium 110 python3 -m kvtier.cli bench engine --device cuda --preset kimi-medium --tiers device,host \
        --repeat 2 --prompt-tokens 2048
    TAILN=6 step host_hit 90 python3 bench/host_hit.py --preset kimi-tiny
    TAILN=14 step adapter 150 python3 -m kvtier.cli bench adapter --device cuda
    TAILN=18 step tiers_device 120 python3 -m kvtier.cli bench tiers --tier device
    TAILN=16 step host_time 60 python3 bench/host_time.py
fi
if [ "$MODE" = suite ] || [ "$MODE" = full ]; then
    # KVTIER_EARLY_FAILURES: each failure's reason as it happens (tests/conftest.py)
    KVTIER_EARLY_FAILURES=1 TAILN=30 step suite 900 sh -c "python3 -m pytest -v -n 14 --dist load -p no:cacheprovider --tb=line -rfE \
        --timeout 200 -m 'not gpu' tests | grep -v -e ' PASSED ' -e PytestBenchmarkWarning -e warner"
fi
echo "## done in $(($(date +%s) - START))s"
