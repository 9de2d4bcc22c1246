#!/usr/bin/env bash
# One device call of the attention loop (session 12): numqsa's planned attention route and
# TensorRT-LLM's kernel on the same inputs, each result checked against the float64 oracle
# (bench/run.py, attention stage only), a short table of numqsa / TensorRT-LLM GPU ms, then, with
# NCU=cases, each kernel of numqsa's chain under Nsight Compute (gpu__time_duration; its cache
# flush makes every kernel read cold). Run from the repository root on the GPU machine with
# carry [".whl", ".peers"], numqsa importable (PYTHONPATH=$PWD plus the carried NumPy 2.4):
#   CASES=1x32K,16x32K,4096x32K NCU=1x32K,256x32K bash bench/attention_chain.sh
# --only matches substrings of case names, so 1x32K also runs 1x32K/bf16 and the head shapes.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/numqsa-out}
CASES=${CASES:-1x32K,4x32K,16x32K,64x32K,256x32K,4096x32K}
mkdir -p "$OUT"
python3 bench/run.py --only "$CASES" --stages attention --impls numqsa,trtllm --no-host \
    --out "$OUT/bench" > "$OUT/bench.log" 2>&1
python3 - "$OUT/bench/latest.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = {}
for r in d["results"]:
    if r["stage"] == "attention" and r["ms_gpu"] is not None:
        rows.setdefault(r["case"], {})[r["impl"]] = r["ms_gpu"]
print(f"{'case':>22} {'numqsa':>8} {'trtllm':>8} {'ratio':>6}")
for case, v in rows.items():
    n, t = v.get("numqsa"), v.get("trtllm")
    if n and t:
        print(f"{case:>22} {n:8.4f} {t:8.4f} {n / t:6.2f}")
bad = [(r["case"], r["impl"], r.get("error")) for r in d["results"]
       if not r["ok"] and not r.get("skipped")]
print("failed rows:", bad)
PY
if [ -n "${NCU:-}" ]; then
    ncu --metrics gpu__time_duration.sum --csv python3 bench/attention_probe.py --cases "$NCU" \
        --iters 1 --reruns 0 --check 2 > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
    python3 - "$OUT/ncu.csv" <<'PY'
import csv, io, sys
lines = [x for x in open(sys.argv[1]).read().splitlines() if x.startswith('"')]
for r in csv.DictReader(io.StringIO("\n".join(lines))):
    print(f'{r["Kernel Name"][:60]:60s} grid {r.get("Grid Size", ""):>14} '
          f'{r["Metric Value"]:>10} {r["Metric Unit"]}')
PY
fi
