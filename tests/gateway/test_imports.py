"""The gateway's imports go one way (issue 24): the routes import the shared state
(gateway/state.py), never the app that includes them, so there is no cycle, counting imports
inside functions; gateway/local.py imports only the ground floor (pagedq/*.py)."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
GROUND_FLOOR = {p.stem for p in (GATEWAY.parent / "pagedq").glob("*.py")} - {"__init__"}


def imported(path: Path) -> set[str]:
    """Every pagedq module ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pagedq")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pagedq"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # from pagedq.gateway import x
    return found


def gateway_graph() -> dict[str, set[str]]:
    names = {p.stem for p in GATEWAY.glob("*.py")}
    return {p.stem: {m.split(".")[2] for m in imported(p)
                     if m.startswith("pagedq.gateway.") and m.split(".")[2] in names} - {p.stem}
            for p in GATEWAY.glob("*.py")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets (each reported once per back edge)."""
    found, state = [], dict.fromkeys(graph, 0)

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state[nxt] == 1:
                found.append([*path[path.index(nxt):], nxt])
            elif state[nxt] == 0:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if state[node] == 0:
            walk(node, [node])
    return found


def test_the_gateway_has_no_import_cycle_counting_function_imports():
    graph = gateway_graph()
    assert "state" in graph["completions"] and "state" in graph["batch_api"]
    assert not any("app" in deps for name, deps in graph.items() if name != "commands")
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_local_imports_only_the_ground_floor():
    mods = imported(GATEWAY / "local.py")
    assert mods and all(m.split(".")[1] in GROUND_FLOOR for m in mods), sorted(mods)
