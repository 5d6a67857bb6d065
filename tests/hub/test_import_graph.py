"""No import cycles inside `hub/`: between modules, and between its top-level parts (a
package such as hub.traffic counts as one part).

Imports are read from the source (`import x`, `from x import y`, at any depth, function-level
ones included), except those under `if TYPE_CHECKING:`, which never run. A cycle fails the
test with its path printed, e.g. `hub.routing -> hub.traffic -> hub.routing`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def hub_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / "hub").rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(module imported from, names) for every import that runs."""
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            found.append((base, [alias.name for alias in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the hub modules it imports."""
    modules = hub_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for base, names in _imports(tree, name, path.name == "__init__.py"):
            targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
            if len(targets) < len(names) or not names:  # some names are attributes of `base`
                parts = base.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts:
                    targets.append(".".join(parts))
            edges.update(t for t in targets if t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as a path whose first and last nodes are equal, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle is not None:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle is not None:
                return cycle
    return None


def _part(module: str, packages: set[str]) -> str:
    """The top-level part of hub a module belongs to: hub.traffic.canary -> hub.traffic."""
    top = ".".join(module.split(".")[:2])
    return top if top in packages else module


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages = {m for m, p in hub_modules().items() if p.name == "__init__.py"}
    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module == "hub":
            continue  # the root package's __init__ imports nothing of its parts
        src = _part(module, packages)
        edges = parts.setdefault(src, set())
        edges.update(_part(t, packages) for t in targets if _part(t, packages) != src)
    return parts


def test_the_graph_sees_imports() -> None:
    """The reader is not blind: known edges are found, TYPE_CHECKING ones are not."""
    graph = import_graph()
    assert "hub.state" in graph["hub.app"]  # from hub.state import Hub
    assert "hub.api.health" in graph["hub.app"]  # from hub.api import (..., health, ...)
    assert "hub.catalog" in graph["hub.control"]
    assert "hub.settings" not in graph["hub.control"]  # only under TYPE_CHECKING
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("level", ["modules", "parts"])
def test_no_import_cycles_in_hub(level: str) -> None:
    graph = import_graph()
    if level == "parts":
        graph = part_graph(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
