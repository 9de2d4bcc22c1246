"""The README's NumPy example is executed as written."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_numpy_example():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- README-EXAMPLE[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert m, "README example block not found"
    exec(compile(m.group(1), "README.md", "exec"), {})


def test_readme_numpy_example_fresh_process_without_simulator_flag():
    """As a user pastes it into a script: no NUMBA_ENABLE_CUDASIM; without a GPU, one notice line."""
    import os
    import subprocess
    import sys
    text = (ROOT / "README.md").read_text()
    code = re.search(r"<!-- README-EXAMPLE[^>]*-->\s*```python\n(.*?)```", text, re.S).group(1)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    notes = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(notes) <= 1, f"expected at most one notice line, got:\n{run.stderr}"
