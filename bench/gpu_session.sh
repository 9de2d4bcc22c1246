#!/usr/bin/env bash
# One device call: the GPU test tier (sm_90 kernels, then the sm_70 kernels under NUMQSA_ARCH=sm_70,
# which the H200 runs by emulating m8n8k4), compute-sanitizer (memcheck, racecheck, synccheck, initcheck) on every kernel and route, the main job,
# and (with --bench) the benchmarks. Full logs and JSON go to $OUT; a short table is printed last.
# Usage on the device machine, from the repo root, through numqsa installed there (bench/gpu_venv.sh:
# a venv beside the machine's CUDA 13 torch, NumPy 2.4 carried in .whl/):
#   source bench/gpu_venv.sh && bash bench/gpu_session.sh [--bench] [pytest -k expression]
set -u -o pipefail
OUT=${OUT:-/tmp/numqsa-out}
LOG=/tmp/numqsa-logs          # the device returns at most 8 files: logs travel as one tarball
mkdir -p "$OUT" "$LOG"
export NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1
BENCH=0; [ "${1:-}" = "--bench" ] && { BENCH=1; shift; }
K=${1:-}
summary=()
step() {   # step NAME LOGFILE SECONDS CMD...: run with a time limit, keep the log, note the outcome
    local name=$1 log=$2 limit=$3; shift 3
    local t0=$SECONDS
    timeout "$limit" "$@" >"$LOG/$log" 2>&1; local rc=$?
    summary+=("$(printf '%-34s %-6s %4ds  %s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" $((SECONDS - t0)) "$(grep -E '^(=+ .* =+|[0-9]+ (passed|failed).*)$' "$LOG/$log" | tail -1)")")
    tail -n 3 "$LOG/$log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOG/device.txt"
python3 -c "import numba, numba.cuda, numpy; print('numba', numba.__version__, 'numpy', numpy.__version__)" | tee -a "$LOG/device.txt"
echo "git ${NUMQSA_REV:-$(git rev-parse HEAD 2>/dev/null)}" | tee -a "$LOG/device.txt"

# Each tier's budget (issue 26): 4 minutes for sm_90, 2 for the sm_70 kernels (130 s and 113 s at
# cd99408, four pytest-xdist processes: tests/conftest.py; sm_90 188 s at 6d53740 with the graph
# branch test's six prefills a case); --durations names the tests to look at when one grows past it.
# The two-GPU tests (issue 25) are a step of their own, on hosts with two GPUs or more.
step "pytest -m gpu (sm_90)" gpu_sm90.log 240 python3 -m pytest -m "gpu and not multi_gpu" -q -p no:cacheprovider --durations=25 ${K:+-k "$K"} tests
# The emulated m8n8k4 kernels are slow on the H200: their tier skips the 131K-context cases, and the
# mma demo tests, which name their instruction themselves (the same kernels as the sm_90 tier's).
step "pytest -m gpu (NUMQSA_ARCH=sm_70)" gpu_sm70.log 120 env NUMQSA_ARCH=sm_70 python3 -m pytest -m "gpu and not multi_gpu" -q -p no:cacheprovider --durations=25 -k "${K:+$K and }not 131072 and not demo_gemm_gpu and not tiles_exact_gpu" tests
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    # not yet run on hardware: no budget measured; -n 2, as the torchrun test holds both GPUs
    step "pytest -m multi_gpu (two GPUs)" multi_gpu.log 600 python3 -m pytest -m multi_gpu -n 2 -q -p no:cacheprovider --durations=25 ${K:+-k "$K"} tests
fi
step "main job" main.log 45 python3 -m numqsa
if command -v compute-sanitizer >/dev/null; then
    # 129 s at b5eb02e (racecheck at 12/1 only; 6/1 joined it since)
    step "compute-sanitizer (bench/sanitize.py)" sanitizer.log 240 python3 bench/sanitize.py --out "$LOG/sanitize" --quick-racecheck
fi
if [ $BENCH = 1 ]; then
    step "bench (bench/run.py)" bench.log 420 python3 bench/run.py --out "$OUT"
fi
echo; printf '%s\n' "${summary[@]}" | tee "$LOG/summary.txt"
cp "$LOG/summary.txt" "$OUT/"
tar czf "$OUT/logs.tgz" -C "$LOG" .
