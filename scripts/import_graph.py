"""The import graph of pagedq's product code: folder arrows, module cycles, function-level imports.

    python scripts/import_graph.py            # the summary
    python scripts/import_graph.py --edges    # also every module-to-module edge that crosses
                                              # folders, with file:line

Reads the source with ``ast`` (nothing is imported), so it sees every import a run could make:
module-level ones and those inside functions (the lazy ones), relative ones resolved against
their package. Imports under ``if TYPE_CHECKING:`` never run, but a module that names another's
types depends on it all the same, so they are edges too (kind "type"; ``--runtime`` drops them).

The folders are the layers: ``pagedq`` (the ground floor: pagedq/*.py and pagedq/tools/),
``client``, ``kernels``, ``worker``, ``gateway`` and ``bench``. A cycle is a strongly connected
component of two or more modules: modules that import each other, directly or around a loop,
counting function-level imports (a lazy import hides a cycle from the interpreter, not from a
reader). tests/test_import_graph.py holds the layering to its rules with these functions.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# top-level folder -> the package it is (pagedq/<name> are links to them, or will be)
FOLDERS = ("client", "kernels", "worker", "gateway", "bench")
GROUND = "pagedq"
LAYERS = (GROUND, *FOLDERS)


@dataclass(frozen=True)
class Edge:
    """One import statement's target inside the product code."""

    source: str  # importing module, e.g. pagedq.worker.service.leases
    target: str  # imported module, e.g. pagedq.worker.service.admission
    kind: str  # "module" (runs at import), "function" (runs when the function does) or "type"
    where: str  # path:line

    @property
    def in_function(self) -> bool:
        return self.kind == "function"


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)  # module name -> file
    edges: list[Edge] = field(default_factory=list)
    function_imports: list[str] = field(default_factory=list)  # path:line of every lazy import

    def successors(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {m: set() for m in self.modules}
        for e in self.edges:
            if e.source != e.target:
                out[e.source].add(e.target)
        return out


def folder_of(module: str) -> str:
    """The layer a module belongs to: pagedq.client.x -> client, pagedq.params -> pagedq."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else GROUND


def discover(root: Path = ROOT) -> dict[str, Path]:
    """Every product module: pagedq/*.py, pagedq/tools/ and the top-level folders, named as
    the interpreter names them (pagedq.worker.engine.engine)."""
    found: dict[str, Path] = {}

    def walk(folder: Path, package: str) -> None:
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path

    for path in sorted((root / GROUND).glob("*.py")):
        name = GROUND if path.stem == "__init__" else f"{GROUND}.{path.stem}"
        found[name] = path
    for sub in sorted((root / GROUND).iterdir()):
        if sub.is_dir() and not sub.is_symlink() and sub.name not in FOLDERS \
                and (sub / "__init__.py").exists():
            walk(sub, f"{GROUND}.{sub.name}")
    for name in FOLDERS:
        if (root / name).is_dir():
            walk(root / name, f"{GROUND}.{name}")
    return found


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(base: str, level: int, package: str) -> str:
    """The absolute module of ``from <level dots><base> import ...`` inside ``package``."""
    if level == 0:
        return base
    parts = package.split(".")
    anchor = parts[: len(parts) - (level - 1)]
    return ".".join([*anchor, base] if base else anchor)


def _targets(node: ast.Import | ast.ImportFrom, package: str,
             modules: dict[str, Path]) -> Iterator[str]:
    """The product modules an import statement loads (the deepest that exists)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _resolve(node.module or "", node.level, package)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                 for alias in node.names]
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name.split(".")[0] == GROUND:
            yield name


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with its kind: "module", "function" (inside a function body) or
    "type" (under ``if TYPE_CHECKING:``)."""
    stack: list[tuple[ast.AST, str]] = [(tree, "module")]
    while stack:
        node, kind = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.append((ast.Module(body=child.body, type_ignores=[]), "type"))
                stack.append((ast.Module(body=child.orelse, type_ignores=[]), kind))
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            lazy = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            stack.append((child, "function" if lazy and kind == "module" else kind))


def build(root: Path = ROOT, runtime: bool = False) -> Graph:
    """The graph of the checkout at ``root``; ``runtime``: leave out TYPE_CHECKING imports."""
    graph = Graph(modules=discover(root))
    for module, path in graph.modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = _package_of(module, path)
        for node, kind in _imports(tree):
            if runtime and kind == "type":
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            if kind == "function":
                graph.function_imports.append(where)
            for target in _targets(node, package, graph.modules):
                graph.edges.append(Edge(module, target, kind, where))
    return graph


def folder_arrows(graph: Graph) -> Counter[tuple[str, str]]:
    """(from folder, to folder) -> number of import edges, folders differing."""
    arrows: Counter[tuple[str, str]] = Counter()
    for e in graph.edges:
        a, b = folder_of(e.source), folder_of(e.target)
        if a != b:
            arrows[(a, b)] += 1
    return arrows


def cycles(graph: Graph) -> list[tuple[str, ...]]:
    """The strongly connected components of two or more modules (Tarjan's algorithm, without
    recursion), each sorted, the list sorted."""
    succ = graph.successors()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[tuple[str, ...]] = []
    counter = 0
    for start in sorted(succ):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(succ[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(tuple(sorted(component)))
    return sorted(found)


def short(module: str) -> str:
    """A module's name without the pagedq. every product module starts with."""
    return module.removeprefix(f"{GROUND}.") if module != GROUND else module


def report(graph: Graph, edges: bool = False) -> str:
    lines = [f"{len(graph.modules)} modules, {len(graph.edges)} import edges", "",
             "folder arrows (import edges):"]
    arrows = folder_arrows(graph)
    for (a, b), n in sorted(arrows.items(), key=lambda kv: (LAYERS.index(kv[0][0]),
                                                           LAYERS.index(kv[0][1]))):
        lines.append(f"  {a:>8} -> {b:<8} {n:>4}")
    found = cycles(graph)
    lines += ["", f"cycles: {len(found)}"]
    lines += [f"  {' <-> '.join(short(m) for m in c)}" for c in found]
    per_folder = Counter(where.split("/")[0] for where in graph.function_imports)
    lines += ["", f"function-level imports: {len(graph.function_imports)} ("
              + ", ".join(f"{k} {v}" for k, v in sorted(per_folder.items())) + ")"]
    if edges:
        lines += ["", "edges across folders:"]
        lines += [f"  {short(e.source)} -> {short(e.target)}"
                  f"{'' if e.kind == 'module' else f' ({e.kind})'}  {e.where}"
                  for e in graph.edges if folder_of(e.source) != folder_of(e.target)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", action="store_true", help="list every cross-folder edge")
    parser.add_argument("--runtime", action="store_true",
                        help="leave out imports under `if TYPE_CHECKING:`")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to read")
    args = parser.parse_args(argv)
    sys.stdout.write(report(build(args.root.resolve(), args.runtime), args.edges) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
