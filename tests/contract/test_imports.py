"""The import rules the layout promises, checked on the source (every import statement,
function-level ones included, since a lazy import is a dependency all the same):

- only `shared/bus/` imports nats (docs/design.md, 'Services');
- no import cycles among the project's modules (a cycle is two modules that are one);
- production code never imports `shared.testing` (fixtures), and `shared/` never `services`;
- `import worker.engine` does not import torch: the mock workers and the CLI stay light.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "worker", "services")


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


def test_production_code_imports_no_test_harness_and_shared_no_service() -> None:
    harness = sorted(
        name
        for name, imported in IMPORTS.items()
        if not name.startswith("shared.testing")
        and any(i.startswith("shared.testing") for i in imported)
    )
    assert harness == []
    upward = sorted(
        name
        for name, imported in IMPORTS.items()
        if name.startswith("shared") and any(i.startswith("services") for i in imported)
    )
    assert upward == []


def test_no_import_cycles() -> None:
    graph = {
        name: {i for i in imported if i in MODULES and i != name}
        for name, imported in IMPORTS.items()
    }
    cycles = _strongly_connected(graph)
    assert cycles == [], f"import cycles: {cycles}"


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


def test_importing_the_engine_package_imports_no_torch() -> None:
    code = (
        "import sys, worker.engine, worker.engine.outputs, worker.engine.checkpoint, "
        "worker.mock_engine, services.admin.cli; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
