#!/usr/bin/env bash
# numqsa installed on the GPU machine, beside its own CUDA 13 PyTorch: a venv that inherits the
# machine's packages, numqsa built from this checkout and pip-installed into it with no index
# (NumPy 2.4 from the wheels in .whl/, everything else already there), and a run directory that
# holds the checkout without its packages, so that tests and benchmarks import the installed
# numqsa (the bench scripts put their checkout first on sys.path). Source it from the repo root:
#   source bench/gpu_venv.sh && bash bench/gpu_session.sh [--bench] [pytest -k expression]
# It leaves the venv first on PATH and the shell in the run directory (NUMQSA_RUN), and prints
# where numqsa, NumPy and torch come from and the CUDA toolchain it compiles with.
# The CUDA 13 install: with its dependencies where .whl/ also holds its toolchain wheels
# (nvidia-nvvm, nvidia-cuda-cccl: 65 MB, more than a run carries); without them numqsa's wheel
# alone, compiling with the machine's own CUDA 13 toolkit (the H200 image has no nvvm wheel).
_nq_main() {
    local root venv site extra
    root=$(pwd)
    venv=${NUMQSA_VENV:-/tmp/numqsa-venv}
    export NUMQSA_RUN=${NUMQSA_RUN:-/tmp/numqsa-run}
    export NUMQSA_REV=${NUMQSA_REV:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
    rm -rf "$venv" "$NUMQSA_RUN"
    # No pip of its own (a venv's base interpreter may lack ensurepip): the inherited pip runs in it.
    python3 -m venv --system-site-packages --without-pip "$venv" || return 1
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # The image's python3 is itself a venv (/opt/torch/.venv); a venv made from it inherits only the
    # base interpreter's packages, so add that venv's own, after this one's: addsitedir runs their
    # .pth files (numba-cuda's redirector), and site.PREFIXES is where cuda.pathfinder looks for the
    # nvidia-* wheels' libraries (torch's NVRTC).
    python3 - "$site/_numqsa_inherit.pth" <<'PY' || return 1
import site, sys
lines = []
if sys.prefix != sys.base_prefix:
    lines = [f"import site; site.PREFIXES.append({sys.prefix!r})\n"]
    lines += [f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()]
open(sys.argv[1], "w").write("".join(lines))
PY
    rm -rf /tmp/numqsa-whl
    "$venv/bin/python" -m pip wheel -q --no-index --no-deps --no-build-isolation -w /tmp/numqsa-whl "$root" || return 1
    whl=$(echo /tmp/numqsa-whl/numqsa-*.whl)    # this checkout's (never a stale one in .whl/)
    if ls .whl/nvidia_nvvm-*.whl .whl/nvidia_cuda_cccl-*.whl >/dev/null 2>&1; then
        "$venv/bin/python" -m pip install -q --no-index --no-cache-dir --find-links "$root/.whl" \
            "$whl[cu13]" || return 1
        echo "gpu_venv: installed numqsa[cu13] into $venv"
    else
        # The CUDA 13 install (plain or [cu13]) less its NVVM and CCCL wheels, which the image's own
        # CUDA 13 toolkit (/usr/local/cuda) provides: NumPy from .whl/, the rest is the image's.
        "$venv/bin/python" -m pip install -q --no-index --no-cache-dir --find-links "$root/.whl" \
            'numpy>=1.26,<2.5' || return 1
        "$venv/bin/python" -m pip install -q --no-index --no-cache-dir --no-deps "$whl" || return 1
        echo "gpu_venv: installed numqsa into $venv (NVVM and CCCL from the image's CUDA 13 toolkit)"
    fi
    # pytest-xdist, for the GPU tier's processes (tests/conftest.py), where .whl/ holds it
    if ls .whl/pytest_xdist-*.whl .whl/execnet-*.whl >/dev/null 2>&1; then
        "$venv/bin/python" -m pip install -q --no-index --no-cache-dir --find-links "$root/.whl" \
            pytest-xdist || return 1
    fi
    "$venv/bin/python" -m pip list --path "$site" 2>/dev/null | tail -n +3 | tr -s ' ' | paste -sd ' ' |
        sed 's/^/gpu_venv: in the venv itself: /'
    mkdir -p "$NUMQSA_RUN"
    (cd "$root" && tar cf - --exclude=./numqsa --exclude=./oracle --exclude=./.whl --exclude=./.git \
        --exclude='*.egg-info' --exclude=./build .) | tar xf - -C "$NUMQSA_RUN" || return 1
    export PATH="$venv/bin:$PATH"
    cd "$NUMQSA_RUN" || return 1
    python3 - <<'PY' || return 1
import numqsa, oracle, numpy, sys
for name, mod in (("numqsa", numqsa), ("oracle", oracle), ("numpy " + numpy.__version__, numpy)):
    print(f"gpu_venv: {name} from {mod.__file__}")
assert sys.prefix in numqsa.__file__ and sys.prefix in oracle.__file__, "numqsa is not the venv's"
try:
    import torch
    print(f"gpu_venv: torch {torch.__version__} from {torch.__file__}")
except ImportError:
    print("gpu_venv: no torch inherited")
PY
    python3 -m numqsa.toolchain --expect 13 | sed 's/^/gpu_venv: /'
    [ "${PIPESTATUS[0]}" = 0 ]
}
_nq_main || { echo "gpu_venv: FAILED" >&2; false; }
