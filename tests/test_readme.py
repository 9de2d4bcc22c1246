"""The README's NumPy example is executed as written."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_numpy_example():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- README-EXAMPLE[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert m, "README example block not found"
    exec(compile(m.group(1), "README.md", "exec"), {})
