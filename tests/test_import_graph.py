"""The layering holds: the ground floor and the kernels import only downward, the kernels load
neither Redis nor the SDK, and no import cycle exists beyond the ones listed here as known.

The graph is scripts/import_graph.py's: read from the source with ``ast``, imports inside
functions and under ``if TYPE_CHECKING:`` included (a lazy or type-only import hides a cycle
from the interpreter, not from a reader).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Cycles other work is removing; the list shrinks to () as it lands (a cycle gone from the code
# must leave this list too: the test compares the two exactly).
KNOWN_CYCLES: list[tuple[str, ...]] = []


def _load_tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


ig = _load_tool()


@pytest.fixture(scope="module")
def graph():
    return ig.build(ROOT)


def upward(graph, source_folder: str, forbidden: set[str]) -> list[str]:
    """Edges from ``source_folder`` into any ``forbidden`` folder, as readable lines."""
    return [f"{e.where}: {ig.short(e.source)} -> {ig.short(e.target)} ({e.kind})"
            for e in graph.edges
            if ig.folder_of(e.source) == source_folder and ig.folder_of(e.target) in forbidden]


def test_the_tool_sees_lazy_relative_and_type_only_imports(tmp_path):
    """An oracle of a made-up tree: each kind of import is found and resolved."""
    for folder in ("pagedq", *ig.FOLDERS):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "pagedq" / "base.py").write_text(
        "def late():\n    from pagedq.client import api\n")
    (tmp_path / "client" / "api.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import util\n"
        "if TYPE_CHECKING:\n    from pagedq.client.util import Thing\n")
    (tmp_path / "client" / "util.py").write_text("from .api import x\nimport pagedq.base\n")
    g = ig.build(tmp_path)
    kinds = {(ig.short(e.source), ig.short(e.target), e.kind) for e in g.edges}
    assert kinds == {("base", "client.api", "function"), ("client.api", "client.util", "module"),
                     ("client.api", "client.util", "type"), ("client.util", "client.api", "module"),
                     ("client.util", "base", "module")}
    assert g.function_imports == ["pagedq/base.py:2"]
    assert ig.cycles(g) == [("pagedq.base", "pagedq.client.api", "pagedq.client.util")]
    assert ig.cycles(ig.build(tmp_path, runtime=True)) == ig.cycles(g)
    assert ig.folder_arrows(g) == {("pagedq", "client"): 1, ("client", "pagedq"): 1}


def test_importing_the_kernels_loads_neither_redis_nor_the_sdk():
    code = ("import sys, pagedq.kernels; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'redis' "
            "or m.startswith('pagedq.client') or m.startswith('pagedq.worker')))")
    # tests/conftest.py's PYTHONPATH: this checkout's pagedq, and no top-level folder by name
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "[]"


def test_the_ground_floor_imports_nothing_above_it(graph):
    assert upward(graph, ig.GROUND, set(ig.FOLDERS)) == []


def test_the_kernels_import_only_the_ground_floor(graph):
    assert upward(graph, "kernels", {"client", "worker", "gateway", "bench"}) == []


def test_the_sdk_imports_only_the_ground_floor(graph):
    assert upward(graph, "client", {"kernels", "worker", "gateway", "bench"}) == []


def test_no_cycles_but_the_known_ones(graph):
    found = [tuple(ig.short(m) for m in c) for c in ig.cycles(graph)]
    assert found == sorted(KNOWN_CYCLES), ig.report(graph)


# Folders whose function-level imports have been gone through: each stays inside its function
# only for an optional dependency or a measured start-up cost, which a comment on it (or on the
# block of imports it belongs to) says.
REASONED = ("bench/", "client/", "gateway/", "kernels/", "pagedq/", "worker/")


def test_each_lazy_import_says_why(graph):
    silent = []
    for where in graph.function_imports:
        path, line = where.rsplit(":", 1)
        if not path.startswith(REASONED):
            continue
        lines = (ROOT / path).read_text().splitlines()
        at = int(line) - 1
        above = at - 1  # the block of imports (and blank lines) this one belongs to, upwards
        while above >= 0 and lines[above].strip().split(" ")[0] in ("from", "import", "") \
                and "#" not in lines[above]:
            above -= 1
        if "#" not in lines[at] and (above < 0 or "#" not in lines[above]):
            silent.append(f"{where}: {lines[at].strip()}")
    assert silent == [], "say why each stays lazy (optional dependency, measured cost):\n" + \
        "\n".join(silent)


# What the gateway may take from the worker: its config layer (the dataclasses and the flags
# derived from them, which `serve`/`batch` hand to the embedded worker), nothing of its CLI,
# engine or service: the gateway is a queue client beside the worker, not a part of it.
WORKER_CONFIG_LAYER = {"pagedq.worker.config", "pagedq.worker.config_flags"}


def test_the_gateway_takes_only_the_workers_config_layer(graph):
    taken = {e.target for e in graph.edges
             if ig.folder_of(e.source) == "gateway" and ig.folder_of(e.target) == "worker"}
    assert "pagedq.worker.config_flags" in taken  # the rule is about edges that exist
    sideways = [f"{e.where}: {ig.short(e.source)} -> {ig.short(e.target)} ({e.kind})"
                for e in graph.edges if ig.folder_of(e.source) == "gateway"
                and ig.folder_of(e.target) == "worker" and e.target not in WORKER_CONFIG_LAYER]
    assert not sideways, "import it from the config layer or the ground floor:\n" + \
        "\n".join(sideways)


def test_the_config_layer_imports_nothing_of_the_workers_commands(graph):
    """The config layer is below the CLI: pagedq.worker.cli imports it, never the reverse."""
    up = [f"{e.where}: {ig.short(e.source)} -> {ig.short(e.target)}" for e in graph.edges
          if e.source in WORKER_CONFIG_LAYER and e.target.startswith("pagedq.worker.")
          and e.target not in WORKER_CONFIG_LAYER]
    assert not up, up


def test_the_gateway_runner_imports_only_the_ground_floor(graph):
    """gateway/local.py starts a Redis and a worker as child processes: it needs the ground
    floor (the embedded Redis, processes, the Redis URL) and nothing of the worker's code."""
    edges = [e for e in graph.edges if e.source == "pagedq.gateway.local"]
    assert edges
    above = [f"{e.where}: {ig.short(e.target)}" for e in edges
             if ig.folder_of(e.target) != "pagedq"]
    assert not above, above


def test_the_bench_imports_absolutely():
    """Relative imports hid the bench's 8-file cycle from a reader: bench/ spells them out."""
    import ast

    relative = [f"{path.name}:{node.lineno}" for path in sorted((ROOT / "bench").glob("*.py"))
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative, f"use `from pagedq.bench import x`: {relative}"


def test_no_two_modules_share_a_file_name():
    """Clashing names (two errors.py, two intake.py) sent a reader to the wrong file: each
    module is named after what it does. A package's __init__.py and __main__.py are the
    interpreter's names and may repeat."""
    from collections import Counter

    names = Counter(path.name for path in ig.discover(ROOT).values()
                    if path.name not in ("__init__.py", "__main__.py"))
    assert [name for name, n in names.items() if n > 1] == []
