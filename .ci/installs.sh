#!/usr/bin/env bash
# CI: the two supported installs, each from the built wheel into a fresh venv, each run from outside
# the checkout: the README NumPy example in the simulator, the toolchain it loads, and the offline
# resource report for the architectures it targets (cu12: sm_70 and sm_90; cu13: sm_90). The cu13
# venv first gets torch 2.11's CUDA 13 packages (as on the H200): the plain install (the CUDA 13
# one, which [cu13] names again) must leave them as
# they are and bring no CUDA 12 package; it must refuse sm_70 with the cu12 install's command.
# The three reports (cu12 sm_70, cu12 sm_90, cu13 sm_90) run side by side; downloads come from
# pip's cache (shared with .ci/run's venv).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export PYTHONUNBUFFERED=1
t0=$SECONDS

work=$(mktemp -d)           # the venvs and the runs: outside the checkout
trap 'rm -rf "$work"' EXIT
rm -rf dist
python3 -m pip wheel -q --no-deps -w dist .
whl=$(echo "$root"/dist/numqsa-*.whl)

python3 -m venv "$work/cu12" && "$work/cu12/bin/pip" install -q -U pip && "$work/cu12/bin/pip" install -q "$whl[cu12]"
# torch 2.11.0's own CUDA requirements (cuda-toolkit ==13.0.2, cuda-bindings >=13.0.3: the H200 has 13.3.1)
theirs=(cuda-bindings==13.3.1 'cuda-toolkit[cudart,nvjitlink,nvrtc]==13.0.2')
python3 -m venv "$work/cu13" && "$work/cu13/bin/pip" install -q -U pip && "$work/cu13/bin/pip" install -q "${theirs[@]}"
before=$("$work/cu13/bin/pip" freeze)
"$work/cu13/bin/pip" install -q "$whl"           # the plain install is the CUDA 13 one
after=$("$work/cu13/bin/pip" freeze)
changed=$(comm -23 <(sort <<<"$before") <(sort <<<"$after"))
[ -z "$changed" ] || { echo "numqsa (CUDA 13) changed the CUDA 13 packages: $changed"; exit 1; }
if grep -i -- '-cu12' <<<"$after"; then echo "numqsa (CUDA 13) brought CUDA 12 packages"; exit 1; fi
# ... and [cu13] names the same set: nothing more to install
"$work/cu13/bin/pip" install -q --dry-run --report "$work/cu13.json" "$whl[cu13]"
"$work/cu13/bin/python" -c 'import json, sys; extra = [i["metadata"]["name"] for i in
    json.load(open(sys.argv[1]))["install"] if i["metadata"]["name"] != "numqsa"]
assert not extra, f"numqsa[cu13] would add {extra} to the plain install"' "$work/cu13.json"
echo "installs: $((SECONDS - t0)) s (wheel, two venvs)"

python3 - "$work/example.py" <<'PY'
import re, sys
text = open("README.md").read()
code = re.search(r"<!-- README-EXAMPLE[^>]*-->\s*```python\n(.*?)```", text, re.S).group(1)
open(sys.argv[1], "w").write(code)
PY
cd "$work"
for v in cu12 cu13; do
    py=$work/$v/bin/python
    echo "== numqsa[$v]"
    NUMBA_ENABLE_CUDASIM=0 "$py" -m numqsa.toolchain --expect "${v#cu}"
    NUMBA_ENABLE_CUDASIM=1 "$py" -c 'import numqsa, sys; assert "site-packages" in numqsa.__file__, numqsa.__file__'
    NUMBA_ENABLE_CUDASIM=1 "$py" example.py
done
# sm_70 on CUDA 13, for real: refused by name, before compiling.
if NUMBA_ENABLE_CUDASIM=0 "$work/cu13/bin/python" -m numqsa.resources --arch sm_70 >refusal.txt 2>&1; then
    echo "numqsa[cu13] did not refuse sm_70"; exit 1
fi
grep -q "pip install 'numqsa\[cu12\]'" refusal.txt || { cat refusal.txt; exit 1; }
grep -m1 "cannot build" refusal.txt

report() {   # report LOG VARIANT ARCH: the resource report in the background
    NUMBA_ENABLE_CUDASIM=0 "$work/$2/bin/python" -m numqsa.resources --check --arch "$3" >"$1" 2>&1 &
}
report cu12_70.txt cu12 sm_70; p1=$!
report cu12_90.txt cu12 sm_90; p2=$!
report cu13_90.txt cu13 sm_90; p3=$!
rc=0
for p in $p1 $p2 $p3; do wait "$p" || rc=1; done
for f in cu12_70 cu12_90 cu13_90; do echo "== resource report $f: $(grep -c ' sm_[79]0 ' $f.txt) kernels"; tail -n 2 $f.txt; done
[ $rc = 0 ] || { cat cu12_70.txt cu12_90.txt cu13_90.txt; exit 1; }
differ=$(diff <(grep ' sm_90 ' cu12_90.txt) <(grep ' sm_90 ' cu13_90.txt) | grep '^[<>]' || true)
echo "sm_90 rows that CUDA 13 compiles differently from CUDA 12 (cu12 <, cu13 >):"
echo "${differ:-(none)}"
echo "installs.sh: both installs ok in $((SECONDS - t0)) s"
