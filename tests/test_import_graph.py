"""The layer rules of ARCHITECTURE.md's layout table, checked on the source, and no import
cycles.

Imports are read from the source of `hub`, `backends`, `registry`, `migrations` and
`benchmarks` (`import x`, `from x import y`, at any depth, function-level ones included),
except those under `if TYPE_CHECKING:`, which never run. An import of anything outside those
packages is an edge to the name it imports from (`torch`, `tests.support.process`). A broken
rule fails the test naming the module, what it imports and the rule; a cycle fails it with its
path, e.g. `hub.routing -> hub.traffic -> hub.routing`.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hub", "backends", "registry", "migrations", "benchmarks")

Graph = dict[str, set[str]]


@dataclass(frozen=True)
class Rule:
    """Modules under `source` never import anything under `forbidden` (directly, or through
    other modules when `transitive`), except the modules under `exempt`."""

    source: str
    forbidden: str
    why: str
    exempt: tuple[str, ...] = ()
    transitive: bool = False


PRODUCT = ("hub", "backends", "registry", "migrations")
KINDS = ("backends.llm", "backends.encoders")
EVERY_KIND = (*KINDS, "backends.kinds", "backends.tiny")  # modules that may import any kind
PURE = tuple(f"backends.llm.{m}" for m in ("scheduler", "block_pool", "kv_cache_manager"))
RULES = (
    Rule("backends", "hub", "backends know nothing of the hub"),
    Rule("backends", "registry", "backends know nothing of the registry"),
    Rule("registry", "hub", "the registry knows nothing of the hub"),
    Rule("registry", "backends", "the registry knows nothing of the backends"),
    Rule("migrations", "hub", "migrations see only the registry's models"),
    Rule("migrations", "backends", "migrations see only the registry's models"),
    *(Rule(p, "tests", "nothing imports tests") for p in (*PRODUCT, "benchmarks")),
    *(Rule(p, "benchmarks", "the product runs without its benchmarks") for p in PRODUCT),
    Rule("backends.llm", "backends.encoders", "one model kind never imports another"),
    Rule("backends.encoders", "backends.llm", "one model kind never imports another"),
    # What the kinds share (base, errors, loading, ...) imports no kind; `backends.kinds`
    # picks the class for a kind and `backends.tiny` builds models of every kind.
    *(Rule("backends", k, "the shared backend modules import no kind", EVERY_KIND) for k in KINDS),
    *(Rule(m, "torch", "the engine's bookkeeping is pure Python", (), True) for m in PURE),
)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    return {
        _module_name(root, p): p
        for package in packages
        for p in sorted((root / package).rglob("*.py"))
    }


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


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> Graph:
    """module -> the modules it imports: those of `packages` by their full name, any other by
    the name it is imported from."""
    known = modules(root, packages)
    graph: Graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for base, names in _imports(tree, name, path.name == "__init__.py"):
            targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            if len(targets) < len(names) or not names:  # some names are attributes of `base`
                parts = base.split(".")
                while parts and ".".join(parts) not in known:
                    parts.pop()
                targets.append(".".join(parts) if parts else base)
            edges.update(t for t in targets if t != name)
        graph[name] = edges
    return graph


def reachable(graph: Graph, start: str) -> set[str]:
    """Every module importing `start` runs, itself excluded: what it imports, at any depth,
    and the packages above each of them (importing `a.b.c` runs `a` and `a.b` first)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        node = todo.pop()
        parts = node.split(".")
        nexts = set(graph.get(node, ())) | {".".join(parts[:i]) for i in range(1, len(parts))}
        for nxt in nexts - seen - {start}:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def violations(graph: Graph, rules: Iterable[Rule] = RULES) -> list[str]:
    """One line per module that breaks a rule: who, what it imports, and the rule."""
    found = []
    for rule in rules:
        for module in sorted(graph):
            if not _under(module, rule.source):
                continue
            if any(_under(module, e) for e in rule.exempt):
                continue
            targets = reachable(graph, module) if rule.transitive else graph[module]
            for target in sorted(t for t in targets if _under(t, rule.forbidden)):
                how = "reaches" if rule.transitive else "imports"
                found.append(f"{module} {how} {target}: {rule.why}")
    return found


def find_cycle(graph: Graph) -> list[str] | None:
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


def part_graph(graph: Graph, package: str) -> Graph:
    """The graph between the top-level parts of `package` (a subpackage such as hub.traffic
    counts as one part; a module directly under `package` is a part of its own)."""
    subpackages = {m for m, p in modules(ROOT, [package]).items() if p.name == "__init__.py"}

    def part(module: str) -> str:
        top = ".".join(module.split(".")[:2])
        return top if top in subpackages else module

    parts: Graph = {}
    for module, targets in graph.items():
        if module == package or not _under(module, package):
            continue  # the root package's __init__ imports nothing of its parts
        src = part(module)
        edges = parts.setdefault(src, set())
        edges.update(part(t) for t in targets if _under(t, package) and part(t) != src)
    return parts


@functools.cache
def repo_graph() -> Graph:
    """The import graph of this checkout, read once per test session."""
    return import_graph()


def test_the_graph_sees_imports() -> None:
    """The reader is not blind: known edges are found, TYPE_CHECKING ones are not."""
    graph = repo_graph()
    assert "hub.state" in graph["hub.app"]  # from hub.state import Hub
    assert "hub.api.health" in graph["hub.app"]  # from hub.api import (..., health, ...)
    assert "hub.catalog" in graph["hub.control"]
    assert "hub.settings" not in graph["hub.control"]  # only under TYPE_CHECKING
    assert "torch" in graph["backends.base"]  # outside the packages: the name imported
    assert "backends.llm.backend" in reachable(graph, "backends.kinds")  # a function's import
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_a_broken_rule_is_reported_with_who_imports_what(tmp_path: Path) -> None:
    """Rules are checked on the files as written: a backend importing the hub inside a
    function, a registry module reaching torch through a helper, a test import."""
    files = {
        "backends/__init__.py": "",
        "backends/fine.py": "import torch\nfrom backends import errors\n",
        "backends/errors.py": "",
        "backends/leaky.py": "def f():\n    from hub.state import Hub\n",
        "registry/__init__.py": "",
        "registry/pure.py": "from registry.helper import x\n",
        "registry/helper.py": "from typing import TYPE_CHECKING\nimport torch\n"
        "if TYPE_CHECKING:\n    from hub import app\n",
        "hub/__init__.py": "",
        "hub/state.py": "from tests.support import fake\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["backends", "registry", "hub"])
    rules = [
        Rule("backends", "hub", "no hub"),
        Rule("hub", "tests", "no tests"),
        Rule("registry.pure", "torch", "pure", transitive=True),
        Rule("registry", "hub", "no hub"),
    ]
    assert violations(graph, rules) == [
        "backends.leaky imports hub.state: no hub",
        "hub.state imports tests.support: no tests",
        "registry.pure reaches torch: pure",
    ]


def test_exempt_modules_may_break_the_rule() -> None:
    graph = {"backends.kinds": {"backends.llm.backend"}, "backends.base": {"backends.llm"}}
    rule = Rule("backends", "backends.llm", "shared", exempt=("backends.kinds",))
    assert violations(graph, [rule]) == ["backends.base imports backends.llm: shared"]


def test_every_layer_rule_holds() -> None:
    broken = violations(repo_graph())
    assert not broken, "layer rules broken:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    "package, level",
    [(p, level) for p in ("hub", "backends", "registry") for level in ("modules", "parts")],
)
def test_no_import_cycles(package: str, level: str) -> None:
    graph = repo_graph()
    if level == "parts":
        graph = part_graph(graph, package)
    else:
        graph = {m: {t for t in ts if _under(t, package)} for m, ts in graph.items()
                 if _under(m, package)}  # fmt: skip
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
