"""The bench's import graph: absolute imports only and no cycle, counting every import
statement wherever it stands (inside functions, under ``if TYPE_CHECKING``).

The oracle is the source itself: each module is parsed with ``ast`` and every ``import`` /
``from ... import`` node is an arrow, so a cycle hidden in a function body still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
PACKAGE = "pagedq.bench"


def bench_modules(root: Path = BENCH) -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in sorted(root.glob("*.py"))
            if p.stem != "__init__"}


def relative_imports(tree: ast.Module) -> list[int]:
    """Line numbers of ``from . import x`` / ``from .x import y``."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]


def arrows(name: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The bench modules ``name`` imports, wherever the import statement stands."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[:2] == ["pagedq", "bench"] and len(parts) > 2:
                    out.add(parts[2])
        elif isinstance(node, ast.ImportFrom):
            base = "bench" if node.level else ""
            mod = node.module or ""
            if node.level:
                parts = [p for p in mod.split(".") if p]
            elif mod.split(".")[:2] == ["pagedq", "bench"]:
                parts = mod.split(".")[2:]
                base = "bench"
            else:
                continue
            if parts:
                out.add(parts[0])
            elif base:  # from pagedq.bench import x: x may be a module
                out.update(a.name for a in node.names if a.name in modules)
    out.discard(name)  # a module's own name in a docstring-style self import is not an arrow
    return out & modules


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def graph_of(root: Path = BENCH) -> dict[str, set[str]]:
    mods = bench_modules(root)
    return {name: arrows(name, tree, set(mods)) for name, tree in mods.items()}


def test_the_cycle_finder_finds_a_cycle_behind_a_function():
    src = {"a": "def f():\n    from pagedq.bench import b\n",
           "b": "from pagedq.bench.c import x\n", "c": "from . import a\n", "d": "import os\n"}
    trees = {k: ast.parse(v) for k, v in src.items()}
    graph = {k: arrows(k, t, set(src)) for k, t in trees.items()}
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert relative_imports(trees["c"]) == [1]


def test_bench_imports_are_absolute():
    rel = {name: lines for name, tree in bench_modules().items()
           if (lines := relative_imports(tree))}
    assert not rel, f"relative imports in bench/ (use `from {PACKAGE} import x`): {rel}"


def test_bench_has_no_import_cycle():
    found = cycles(graph_of())
    assert not found, f"import cycles among bench modules: {found}"
