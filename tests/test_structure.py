"""The package's shape: import graphs without cycles, profiles shipped inside the package.

The import graph is read from the source (``ast``), not by importing: an edge a → b for every
``import`` / ``from ... import`` of an edgekv module in a's file — at module level, or anywhere
in the file (imports inside functions too) — plus the packages an import initialises on the way
(``import a.b.c`` runs ``a/b/__init__``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "edgekv"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(module_level_only: bool) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes = tree.body if module_level_only else list(ast.walk(tree))
        targets: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)] + ([node.module] if node.module else [])
                    module = ".".join(base)
                else:
                    module = node.module or ""
                for a in node.names:  # `from pkg import mod` imports the module pkg.mod
                    targets.add(f"{module}.{a.name}" if f"{module}.{a.name}" in files else module)
        edges = set()
        for t in targets:
            parts = t.split(".")
            for i in range(1, len(parts) + 1):  # the packages on the way are initialised too
                dep = ".".join(parts[:i])
                if dep in files and dep != name and not name.startswith(dep + "."):
                    edges.add(dep)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]], within: str) -> list[list[str]]:
    """The strongly connected components of more than one module among ``within`` and below."""
    nodes = sorted(n for n in graph if n == within or n.startswith(within + "."))
    inside = set(nodes)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v] & inside):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return found


def test_no_module_level_import_cycle_in_edgekv():
    assert cycles(import_graph(module_level_only=True), "edgekv") == []


def test_no_import_cycle_in_edgekv_at_any_level():
    """Not even an import inside a function closes a circle anywhere in the package: models →
    policies → engine / compiler (frontend → passes → backend → driver, with ``errors.py`` and
    ``relax_util.py`` as shared leaves) → runtime → session / job → cli."""
    assert cycles(import_graph(module_level_only=False), "edgekv") == []


def test_profiles_are_package_data():
    """The target and device profiles live inside the package (a wheel ships them) and are
    found through it, not through the source checkout."""
    from edgekv.compiler.backend.target import PROFILE_DIR, resolve_target
    from edgekv.simulate.profiles import DEVICE_DIR, load_profiles

    for folder in (PROFILE_DIR, DEVICE_DIR):
        assert folder.is_dir() and PACKAGE in folder.resolve().parents, folder
    assert {"host", "cuda", "opencl", "android-cpu"} <= {p.stem for p in PROFILE_DIR.glob("*.json")}
    assert resolve_target("opencl")[0]["name"] == "opencl"
    assert load_profiles(None)
