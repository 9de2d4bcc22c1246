"""Every kernel compiles for sm_70 and sm_90 offline, with no spills and V100-legal shared memory."""
import json
import os
import subprocess
import sys


def test_resource_report(tmp_path):
    out = tmp_path / "resources.json"
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    proc = subprocess.run([sys.executable, "-m", "numqsa.resources", "--check", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    archs = {(r["module"], r["arch"]) for r in rows}
    modules = {r["module"] for r in rows}
    for mod in modules:
        assert (mod, "sm_70") in archs and (mod, "sm_90") in archs, f"{mod} lacks an sm_70 or sm_90 build"
    for r in rows:
        assert r["regs"] > 0 and r["spill_st"] == 0 and r["spill_ld"] == 0, r
        assert r["blocks_per_sm"] >= 1, r
