"""The package's layout shows which process runs a file, and its imports keep it true.

``nb_dist/_shared`` is imported by both sides and imports nothing above it; ``_rank`` runs in
a rank and never loads the kernel's machinery; ``_kernel`` runs in the launching process and
takes from ``_rank`` only what a process is started with; ``_live`` builds on ``_kernel``;
``_cluster`` is the kernel side of a launch on a cluster and ``_node`` runs in each node's
agent there; ``views`` are teaching widgets. No import circle, deferred imports included (a
circle that works only because an import sits inside a function breaks when someone hoists
it).
Read statically (ast): nothing here imports the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

PACKAGE = Path(__file__).resolve().parent.parent / "nb_dist"

# What each layer may import from nb_dist (by module-name prefix); the layer itself is allowed.
ALLOWED: dict[str, tuple[str, ...]] = {
    "nb_dist._shared": (),
    "nb_dist._rank": ("nb_dist._shared",),
    "nb_dist._starter": (
        "nb_dist._shared",
        "nb_dist._rank._spec",  # what a rank is started with
        "nb_dist._rank._entry",  # the function a forked or forkserver process runs
    ),
    "nb_dist._kernel": (
        "nb_dist._shared",
        "nb_dist._starter",
        "nb_dist._rank._spec",  # what a rank is started with
        "nb_dist._rank._as_main",  # the function run_script's ranks run (a script as __main__)
        "nb_dist.views._display",  # the launch monitor is a widget on the views' base
        "nb_dist.views.colors",
    ),
    "nb_dist._live": (
        "nb_dist._shared",
        "nb_dist._starter",
        "nb_dist._kernel",
        "nb_dist._rank._regroup",  # the functions a session calls on its ranks to free them
    ),
    "nb_dist._cluster": (
        "nb_dist._shared",
        "nb_dist._starter",
        "nb_dist._kernel",
        "nb_dist._rank._spec",  # what a rank is started with, sent to its node's agent
        "nb_dist._node",  # the agent class placed on each node, and what its polls return
    ),
    "nb_dist._node": (
        "nb_dist._shared",
        "nb_dist._rank._spec",
        "nb_dist._rank._regroup",  # the node's ranks' socket addresses, to free a blocked one
        "nb_dist._starter",  # the node's ranks start as the kernel's local ones do
    ),
    "nb_dist.views": (),
    "nb_dist.teach": (),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    name: str, source: str, is_package: bool, known: set[str], type_only: bool = False
) -> set[str]:
    """The nb_dist modules ``name`` imports, at any depth (deferred imports included); those
    under ``TYPE_CHECKING`` only with ``type_only``."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("nb_dist"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("nb_dist"):
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in known else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    found.discard(name)
    return found


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {
        name: _imports(name, path.read_text(), path.name == "__init__.py", known, type_only)
        for name, path in modules.items()
    }


def _layer(name: str) -> str | None:
    for layer in ALLOWED:
        if name == layer or name.startswith(layer + "."):
            return layer
    return None


def _violations(graph: dict[str, set[str]], layer: str) -> list[str]:
    allowed = (layer, *ALLOWED[layer])
    return sorted(
        f"{name} imports {target}"
        for name, imported in graph.items()
        if _layer(name) == layer
        for target in imported
        if not any(target == a or target.startswith(a + ".") for a in allowed)
    )


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """Depth-first search for a back edge: the first circle found, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph.get(name, ())):
            module = target if target in graph else target.rpartition(".")[0]
            if module not in graph:
                continue
            if state.get(module) == 1:
                return [*path[path.index(module) :], module]
            if module not in state:
                found = walk(module)
                if found:
                    return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = walk(name)
            if found:
                return found
    return None


GRAPH = _graph()


def test_the_layers_are_there():
    layers = {_layer(name) for name in GRAPH}
    assert set(ALLOWED) <= layers, f"missing: {set(ALLOWED) - layers}"
    # The top level holds only the public front door (and what importing it does, which runs
    # in every process, a rank's too) and the command line.
    top = {name for name in GRAPH if _layer(name) is None}
    front = {"nb_dist", "nb_dist._at_import", "nb_dist.__main__", "nb_dist._cli", "nb_dist._demo"}
    assert top == front, top


@pytest.mark.parametrize("layer", list(ALLOWED))
def test_a_layer_imports_only_what_is_below_it(layer):
    wrong = _violations(GRAPH, layer)
    assert not wrong, "\n".join(wrong)


def test_no_import_circle():
    circle = _circle(GRAPH)
    assert circle is None, " -> ".join(circle or [])


def test_no_import_circle_even_through_type_only_imports():
    """A circle of type-only imports runs, but says two modules describe each other: the
    seam between them is in the wrong place."""
    circle = _circle(_graph(type_only=True))
    assert circle is None, " -> ".join(circle or [])


def test_every_module_says_where_it_runs():
    """Each subpackage's docstring names its process; each module has a docstring."""
    for name, path in _modules().items():
        assert ast.get_docstring(ast.parse(path.read_text())), f"{name} has no docstring"
    for layer, words in {
        "_shared": "both sides",
        "_rank": "inside a rank's process",
        "_starter": "starts ranks",
        "_kernel": "runs in the kernel",
        "_live": "kernel side",
        "_cluster": "runs in the kernel",
        "_node": "node agent",
    }.items():
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))
        assert doc and words in doc, (layer, doc)


def test_the_checks_find_a_planted_breach():
    """A rank module that imports the kernel, and a deferred import that closes a circle,
    planted into a copy of the real graph: both are found."""
    known = set(GRAPH) | {"nb_dist._rank._planted"}
    source = "def later():\n    from .._kernel import _plan\n"
    planted = dict(GRAPH)
    planted["nb_dist._rank._planted"] = _imports("nb_dist._rank._planted", source, False, known)
    assert planted["nb_dist._rank._planted"] == {"nb_dist._kernel._plan"}
    assert _violations(planted, "nb_dist._rank") == [
        "nb_dist._rank._planted imports nb_dist._kernel._plan"
    ]
    planted["nb_dist._shared._protocol"] = GRAPH["nb_dist._shared._protocol"] | {
        "nb_dist._rank._planted"
    }
    planted["nb_dist._rank._planted"] |= {"nb_dist._shared._protocol"}
    circle = _circle(planted)
    assert circle is not None and "nb_dist._rank._planted" in circle, circle
