"""The package's layers look only down (docs/pipeline.md#layers): read from the sources with ``ast``,
every import of a numqsa module (lazy ones inside functions included) goes to a module of the same
layer or a lower one, the imports form no cycle, and the oracle imports neither numqsa nor numba."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Bottom to top; a module belongs to the layer of its longest listed prefix.
LAYERS = (
    ("base", ("numqsa.jit", "numqsa.toolchain", "numqsa.plan", "numqsa.device", "numqsa.launch")),
    ("kernels", ("numqsa.kernels",)),
    ("stages", ("numqsa.stages",)),
    ("wrapper", ("numqsa.wrapper",)),
    ("api", ("numqsa.api",)),
    ("package", ("numqsa", "numqsa.__main__", "numqsa.testing", "numqsa.resources",
                 "numqsa.integrations")),
)


def _modules(package, root=ROOT):
    out = {}
    for f in sorted((root / package).rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imports(name, path, known):
    """The modules ``name`` imports, resolved to entries of ``known`` (or any absolute name)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:        # `from . import device` names a module, not a symbol
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in known else mod)
    return found


def _layer(name):
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (rank, len(p))
    assert best is not None, f"{name} is in no layer of tests/test_layers.py"
    return best[0]


def _graph(root=ROOT):
    mods = _modules("numqsa", root)
    return {n: {m for m in _imports(n, f, mods) if m in mods and m != n} for n, f in mods.items()}


def _upward(graph):
    return [f"{n} ({LAYERS[_layer(n)][0]}) imports {m} ({LAYERS[_layer(m)][0]})"
            for n, deps in sorted(graph.items()) for m in sorted(deps) if _layer(m) > _layer(n)]


def _cycles(graph):
    state, found = {}, []

    def visit(n, path):
        state[n] = "open"
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                found.append(" -> ".join(path[path.index(m):] + [m]))
            elif m not in state:
                visit(m, path + [m])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return found


def test_every_import_runs_down_or_sideways():
    bad = _upward(_graph())
    assert not bad, "imports that run upward:\n" + "\n".join(bad)


def test_imports_form_no_cycle():
    bad = _cycles(_graph())
    assert not bad, "import cycles:\n" + "\n".join(bad)


def test_the_oracle_imports_no_numqsa_and_no_numba():
    mods = _modules("oracle")
    bad = [f"{n} imports {m}" for n, f in mods.items() for m in sorted(_imports(n, f, mods))
           if m and m.split(".")[0] in ("numqsa", "numba")]
    assert not bad, "\n".join(bad)


def test_the_walk_finds_a_lazy_upward_import_and_its_cycle(tmp_path):
    """A kernel module that imports the wrapper inside a function, the wrapper importing it back."""
    (tmp_path / "numqsa" / "kernels").mkdir(parents=True)
    for rel, text in (("__init__.py", ""), ("kernels/__init__.py", ""),
                      ("kernels/x.py", "def f():\n    from ..wrapper import W\n"),
                      ("wrapper.py", "from .kernels import x\nfrom . import device as dev\n"),
                      ("device.py", "")):
        (tmp_path / "numqsa" / rel).write_text(text)
    graph = _graph(tmp_path)
    assert graph["numqsa.wrapper"] == {"numqsa.kernels.x", "numqsa.device"}
    assert _upward(graph) == ["numqsa.kernels.x (kernels) imports numqsa.wrapper (wrapper)"]
    assert _cycles(graph) == ["numqsa.kernels.x -> numqsa.wrapper -> numqsa.kernels.x"]
