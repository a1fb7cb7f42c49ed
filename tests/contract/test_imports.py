"""The import rules the layout promises, checked on the source (every import statement,
function-level ones included, since a lazy import is a dependency all the same):

- three layers, each importing only those below it (docs/design.md, 'Code layout'): `shared/`
  (the platform every process runs on) imports neither `worker` nor `services`, `worker/` (the
  workers' machinery) does not import `services`;
- only `shared/bus/` imports nats (docs/design.md, 'Services');
- no import cycles among the project's modules (a cycle is two modules that are one), nor
  among its packages (two packages that import each other are one package in two places);
- production code never imports `shared.testing` (fixtures);
- `import worker.engine` does not import torch: the CLI stays light.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from itertools import pairwise
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "worker", "services")
LAYERS = {top: rank for rank, top in enumerate(PACKAGES)}  # each imports only lower ranks


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for top in PACKAGES for p in (REPO / top).rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Every module named by an import in `path` (for `from a import b`: a.b when that is a
    module of ours, else a)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in MODULES else node.module)
    return names


IMPORTS = {name: _imports(path) for name, path in MODULES.items()}


def test_only_the_bus_imports_nats() -> None:
    offenders = sorted(
        name
        for name, imported in IMPORTS.items()
        if not name.startswith("shared.bus")
        and any(i == "nats" or i.startswith("nats.") for i in imported)
    )
    assert offenders == []


def test_production_code_imports_no_test_harness() -> None:
    harness = sorted(
        name
        for name, imported in IMPORTS.items()
        if not name.startswith("shared.testing")
        and any(i.startswith("shared.testing") for i in imported)
    )
    assert harness == []


def test_each_layer_imports_only_the_layers_below() -> None:
    upward = sorted(
        f"{name} imports {i}"
        for name, imported in IMPORTS.items()
        for i in imported
        if LAYERS.get(i.split(".")[0], -1) > LAYERS[name.split(".")[0]]
    )
    assert upward == []


def test_no_import_cycles() -> None:
    graph = {
        name: {i for i in imported if i in MODULES and i != name}
        for name, imported in IMPORTS.items()
    }
    cycles = _strongly_connected(graph)
    assert cycles == [], f"import cycles: {cycles}"


def _package(module: str) -> str:
    """A module's package, as the package cycles count them: its name's first two parts
    (`worker.engine.runner` -> `worker.engine`; `shared.config`, a module of the platform's
    top, is a node of its own)."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycles_among_packages() -> None:
    because: dict[tuple[str, str], str] = {}  # (package, package) -> one import behind it
    for name, imported in sorted(IMPORTS.items()):
        for i in sorted(imported):
            if i in MODULES and _package(i) != _package(name):
                because.setdefault((_package(name), _package(i)), f"{name} imports {i}")
    graph: dict[str, set[str]] = {_package(name): set() for name in MODULES}
    for source, target in because:
        graph[source].add(target)
    components = _strongly_connected(graph)
    assert components == [], "package import cycles:\n" + "\n".join(
        f"{', '.join(component)} import one another, e.g.\n  "
        + " -> ".join(cycle)
        + "".join(f"\n    {because[hop]}" for hop in pairwise(cycle))
        for component, cycle in ((c, _a_cycle(c, graph)) for c in components)
    )


def _a_cycle(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first member, as the path that walks it
    (first member again at the end): what the failure names, with the imports behind it."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & members):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _strongly_connected(graph) == [["a", "b", "c"]]


def test_a_package_cycle_is_reported_as_its_path() -> None:
    assert _package("worker.engine.runner") == "worker.engine"
    assert _package("shared.config") == "shared.config"
    graph = {"a": {"b", "d"}, "b": {"c"}, "c": {"a", "b"}, "d": {"c"}}
    assert _a_cycle(["a", "b", "c", "d"], graph) == ["a", "b", "c", "a"]


def test_importing_the_engine_package_imports_no_torch() -> None:
    code = (
        "import sys, worker.engine, worker.engine.outputs, worker.engine.checkpoint, "
        "worker.mock_engine, services.admin.cli; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
