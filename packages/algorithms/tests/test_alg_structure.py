"""The algorithms package's structure rules (DESIGN.md section 5), checked on its source.

- no import cycle between its modules, counting imports under ``TYPE_CHECKING`` and inside functions;
- no module outside ``engine/`` reads a private member of an engine (``engine._x``);
- no source file over 450 lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import shardforge.algorithms as algorithms

ROOT = Path(algorithms.__file__).parent
PACKAGE = "shardforge.algorithms"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every algorithms module ``path`` imports (anywhere in the file), as the most specific module name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith(PACKAGE + ".") or name == PACKAGE:
                found.add(name)
    return found


def _package_of(module: str) -> str:
    """A module's import of its own package's ``__init__`` is not a cycle we care about."""
    return module.rpartition(".")[0]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle in ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    sources = _sources()
    modules = set(sources)
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        # Package __init__ files only re-export their children; an edge child -> parent package
        # would make every re-export look like a cycle.
        deps = {d for d in _imports(path, modules) if d != name and not name.startswith(d + ".")}
        if path.name == "__init__.py":
            deps = {d for d in deps if not d.startswith(name + ".")}
        graph[name] = deps
    return graph


def test_find_cycle_finds_a_planted_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_the_algorithms_package() -> None:
    graph = import_graph()
    assert len(graph) > 40  # the walk found the package
    assert find_cycle(graph) is None, find_cycle(graph)


def test_no_private_engine_member_read_outside_engine() -> None:
    pattern = re.compile(r"\bengine_?\w*\._[a-z]\w*")
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).parts[0] == "engine":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, offenders


def test_no_source_file_over_450_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long
