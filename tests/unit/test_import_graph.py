"""The package's import graph, read from the source with `ast` (nothing is imported): no import circles, counting
imports inside functions too (a deferred import hides a circle, it does not remove it; `if TYPE_CHECKING:` blocks
never run and are left out), and config/ imports nothing of the implementation (docs/ARCHITECTURE.md).

An import of `a.b.c` is an edge to the deepest module of that name that exists; `from a.b import c` to the
module a.b.c when there is one, else to a.b (c is a name defined there)."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of `package` under `root` by dotted name (a package by its name, its __init__.py the file)."""
    out = {}
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, mods: dict[str, Path], annotations: bool = False) -> set[str]:
    """The modules of `mods` that module `name` imports, anywhere in its body but TYPE_CHECKING blocks (those too
    with `annotations`)."""

    def deepest(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str | None] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not annotations and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(deepest(a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the module's package, one level up per extra dot
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([child.module] if child.module else []))
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else deepest(base) for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m is not None and m != name}


def import_graph(root: Path, package: str, annotations: bool = False) -> dict[str, set[str]]:
    mods = modules(root, package)
    return {name: imports(name, path, mods, annotations) for name, path in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@cache
def package_graph() -> dict[str, set[str]]:
    return import_graph(ROOT, "mlaserve")


def test_the_package_has_no_import_circles():
    graph = package_graph()
    assert len(graph) > 150 and sum(map(len, graph.values())) > 400  # the whole package was read
    assert circles(graph) == []


def test_config_imports_nothing_of_the_implementation():
    graph = package_graph()
    config = {name: deps for name, deps in graph.items() if name.startswith("mlaserve.config")}
    assert len(config) > 20
    outside = {name: sorted(d for d in deps if not d.startswith("mlaserve.config")) for name, deps in config.items()}
    assert {name: deps for name, deps in outside.items() if deps} == {}


def test_the_checks_see_a_circle_a_deferred_one_and_ignore_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from pkg.b import x\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\nx = 1\n",
        "c.py": "def f():\n    from .sub import d\n",  # a deferred import, relative
        "sub/__init__.py": "",
        "sub/d.py": "import pkg.c\n",
        "e.py": "from pkg.b import x\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == set()  # the TYPE_CHECKING import is not an edge
    assert graph["pkg.c"] == {"pkg.sub.d"}
    assert circles(graph) == [["pkg.c", "pkg.sub.d"]]
    (pkg / "b.py").write_text("from pkg import a\nx = 1\n")
    assert circles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub.d"]]
