#!/usr/bin/env bash
# One device call: the GPU test tier (sm_90 kernels, then the sm_70 kernels under NUMQSA_ARCH=sm_70,
# which the H200 runs by emulating m8n8k4), compute-sanitizer on one case per kernel, the main job,
# and (with --bench) the benchmarks. Full logs and JSON go to $OUT; a short table is printed last.
# Usage on the device machine, from the repo root, after the wheel install line of bench/NOTES.md:
#   bash bench/gpu_session.sh [--bench] [pytest -k expression]
set -u -o pipefail
OUT=${OUT:-/tmp/numqsa-out}
mkdir -p "$OUT"
export NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1
BENCH=0; [ "${1:-}" = "--bench" ] && { BENCH=1; shift; }
K=${1:-}
summary=()
step() {   # step NAME LOGFILE CMD...: run, keep the log, remember pass/fail and the duration
    local name=$1 log=$2; shift 2
    local t0=$SECONDS
    "$@" >"$OUT/$log" 2>&1; local rc=$?
    summary+=("$(printf '%-34s %-6s %4ds  %s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" $((SECONDS - t0)) "$(grep -E '^(=+ .* =+|[0-9]+ passed.*)$' "$OUT/$log" | tail -1)")")
    tail -n 3 "$OUT/$log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import numba, numba.cuda, numpy; print('numba', numba.__version__, 'numpy', numpy.__version__)" | tee -a "$OUT/device.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/device.txt"

step "pytest -m gpu (sm_90)" gpu_sm90.log python3 -m pytest -m gpu -q -p no:cacheprovider ${K:+-k "$K"} tests
step "pytest -m gpu (NUMQSA_ARCH=sm_70)" gpu_sm70.log env NUMQSA_ARCH=sm_70 python3 -m pytest -m gpu -q -p no:cacheprovider ${K:+-k "$K"} tests
step "main job" main.log python3 -m numqsa
if command -v compute-sanitizer >/dev/null; then
    step "compute-sanitizer memcheck" sanitizer.log compute-sanitizer --tool memcheck --error-exitcode 9 python3 bench/sanitize_cases.py
fi
if [ $BENCH = 1 ]; then
    step "bench" bench.log python3 bench/run.py --json "$OUT/bench.json"
fi
echo; printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
