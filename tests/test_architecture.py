"""The package's shape: stages that import only from earlier ones, a torch-free solver side,
files a reader can hold, and docstring examples that run.

The import graph is read from the source (every ``import`` statement, those inside
functions included), so a lazy import that points backwards is caught too.
"""

from __future__ import annotations

import ast
import doctest
import importlib
from pathlib import Path

import networkx as nx
import pytest

import ckptopt

ROOT = Path(ckptopt.__file__).resolve().parent
MAX_LINES = 800

# The stages, in the order the data flows (model -> tracer -> costs -> solvers -> plan -> rewriter
# -> module, the simulator scoring plans). A module may import from its own stage or earlier ones.
STAGES = [
    ("errors", "units"),
    ("costs", "cost_fields", "plan", "sides", "segment_cost"),
    ("simulator",),
    ("solvers",),
    ("torch_utils", "storages", "tracker", "fake"),
    ("tracer",),
    ("rewriter", "inplace"),
    ("api", "measure", "planning", "calibration"),
    ("cli", "zoo", "_models"),
]
TORCH_FREE = {"errors", "units", "costs", "cost_fields", "plan", "sides", "segment_cost", "simulator", "solvers"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str, source: str | None = None) -> list[str]:
    """Every module ``name`` imports (absolute names; external ones too), function bodies included."""
    tree = ast.parse(MODULES[name].read_text() if source is None else source)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(name)
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            out += subs if len(subs) == len(node.names) else [target] + subs
    return out


def _stage(name: str) -> int | None:
    """The stage of a ckptopt module (None for the root package, the facade)."""
    if name == "ckptopt":
        return None
    head = name.split(".")[1]
    return next(k for k, heads in enumerate(STAGES) if head in heads)


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for name in MODULES:
        g.add_node(name)
        for target in _imports(name):
            g.add_edge(name, target)
    return g


GRAPH = _graph()


def test_every_module_belongs_to_a_stage():
    assert all(_stage(name) is not None for name in MODULES if name != "ckptopt")


def test_import_graph_has_no_cycle():
    internal = GRAPH.subgraph(MODULES)
    cycles = list(nx.simple_cycles(internal))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_stages_import_only_from_earlier_ones():
    backwards = []
    for src, dst in GRAPH.edges:
        if src not in MODULES or dst not in MODULES or src == "ckptopt":
            continue
        if dst == "ckptopt":
            backwards.append(f"{src} imports the root package (import from the module that defines the name)")
        elif _stage(dst) > _stage(src):
            backwards.append(f"{src} (stage {_stage(src)}) imports {dst} (stage {_stage(dst)})")
    assert not backwards, "\n".join(backwards)


def test_solver_side_imports_no_torch():
    bad = []
    for name in MODULES:
        if name == "ckptopt" or name.split(".")[1] not in TORCH_FREE:
            continue
        for dep in nx.descendants(GRAPH, name) | {name}:
            if dep == "torch" or dep.startswith("torch."):
                bad.append(f"{name} reaches {dep}")
    assert not bad, bad


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_source_file_is_too_long(name):
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines; split it along its stages"


MAX_FUNCTION_LINES = 100
#: Compiled kernels that must stay one loop (each says why in its docstring).
ONE_LOOP_KERNELS = {"ckptopt.solvers.rows.segment_row", "ckptopt.simulator.side_tensors.side_terms_frame"}


def _long_functions(name: str, source: str | None = None) -> list[str]:
    """Functions whose code (signature and body, the docstring apart) is over the limit."""
    tree = ast.parse(MODULES[name].read_text() if source is None else source)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            doc = node.body[0] if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
                getattr(node.body[0], "value", None), ast.Constant) and isinstance(node.body[0].value.value, str) else None
            if doc is not None:
                lines -= doc.end_lineno - doc.lineno + 1
            if lines > MAX_FUNCTION_LINES and f"{name}.{node.name}" not in ONE_LOOP_KERNELS:
                out.append(f"{name}.{node.name}: {lines} lines")
    return out


def test_no_function_is_too_long():
    """A function past a screen or two usually hides a data structure that wants a name; the compiled
    kernels that must stay one loop are listed, and say why."""
    found = [line for name in MODULES for line in _long_functions(name)]
    assert not found, "split these into named parts:\n" + "\n".join(found)
    assert _long_functions("ckptopt.costs", "def f():\n" + "    x = 1\n" * 101)  # (the reader counts code ...)
    assert not _long_functions("ckptopt.costs", 'def f():\n    """\n' + "    doc\n" * 101 + '    """\n')  # (... only)
    for kernel in ONE_LOOP_KERNELS:
        module, _, fn = kernel.rpartition(".")
        assert "One loop by design" in getattr(importlib.import_module(module), fn).__doc__, kernel


def _private_imports(name: str, source: str | None = None) -> list[str]:
    """The private names (``_x``) module ``name`` imports from another ckptopt module."""
    tree = ast.parse(MODULES[name].read_text() if source is None else source)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ckptopt")):
            out += [f"{name}:{node.lineno} imports {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_module_imports_another_modules_private_names():
    """What a module shares it names without an underscore: a private name imported elsewhere is a
    rule with two homes, or a public helper that does not say so."""
    found = [line for name in MODULES for line in _private_imports(name)]
    assert not found, "\n".join(found)
    assert _private_imports("ckptopt.tracer.chain", "from .cuts import _mutated\n")  # (the reader sees one)


def test_root_all_is_what_the_readme_documents():
    """Every name of ``ckptopt.__all__`` resolves, and the README's API table names each of them."""
    readme = (ROOT.parents[1] / "README.md").read_text()
    for name in ckptopt.__all__:
        assert getattr(ckptopt, name) is not None
        assert f"`{name}" in readme, f"ckptopt.{name} is public but the README does not document it"


def test_graph_reading_catches_a_lazy_backward_import():
    """The reader sees imports inside functions (the measure <-> tracer cycle was one) and resolves
    relative ones, so the tests above would fail on such an import."""
    src = "def f():\n    from ..measure import measure_peak\n    from . import cuts\n    import torch.fx\n"
    found = _imports("ckptopt.tracer.chain", src)
    assert found == ["ckptopt.measure", "ckptopt.tracer.cuts", "torch.fx"]
    assert _stage("ckptopt.measure") > _stage("ckptopt.tracer.chain")


def _doctest_modules() -> list[str]:
    names = []
    for name, path in MODULES.items():
        if ">>>" in path.read_text():
            names.append(name)
    return sorted(names)


@pytest.mark.parametrize("name", _doctest_modules())
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, f"{name} has '>>>' but no example ran"
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (run python -m doctest)"
