"""The code's files stand in floors: no import circle in rlactors/, nodes/, recipes/ or protocols/,
and the runtime's wire and socket layers never reach up to its user-facing API.

Every import statement counts: at module level, under ``if TYPE_CHECKING:``, and inside functions
(a deferred import is still a dependency; deferring it only hides a circle from the interpreter).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rlactors", "protocols")
EVERY_PACKAGE = ("protocols", "rlactors", "nodes", "recipes")

# The user-facing API: nothing below it may import these.
USER_API = {"rlactors", "rlactors.api.actor", "rlactors.api.cluster", "rlactors.api.handle"}
# Wire, sockets and serving: the floors the user-facing API stands on.
LOWER_FLOORS = {
    "protocols.runtime.codec",
    "protocols.runtime.wire",
    "rlactors.wire.transport",
    "rlactors.wire.client",
    "rlactors.wire.service",
    "rlactors.wire.methods",
    "rlactors.wire.runtime",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports, by any import statement anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from rlactors.base import logging` imports the module rlactors.base.logging, not the package
            names = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            names = names or [node.module]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def import_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))}
    modules = set(files)
    return {name: _imports(path, modules) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``a → … → a``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycle_in_the_runtime() -> None:
    graph = import_graph()
    # The package __init__ re-exports the public API and is imported by nobody inside.
    assert not [m for m, deps in graph.items() if "rlactors" in deps], "a module imports the package root"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " → ".join(cycle or [])


def test_no_import_cycle_anywhere() -> None:
    """Not between the RL roles either: a module that configures workflows finds one by its import
    path, as it finds any, and a file split by size that calls back into its other half is one."""
    cycle = find_cycle(import_graph(EVERY_PACKAGE))
    assert cycle is None, "import circle: " + " → ".join(cycle or [])


def test_lower_floors_do_not_import_the_user_api() -> None:
    graph = import_graph()
    upward = {m: sorted(graph[m] & USER_API) for m in sorted(LOWER_FLOORS) if graph[m] & USER_API}
    assert not upward, f"wire/socket modules import the user-facing API: {upward}"
    assert not [
        m for m in graph if m.startswith("protocols") and any(d.startswith("rlactors") for d in graph[m])
    ]


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_find_cycle_finds_a_circle(graph: dict[str, set[str]], expected: list[str] | None) -> None:
    assert find_cycle(graph) == expected


def test_the_graph_sees_deferred_and_type_checking_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rlactors.api.cluster import Cluster\n"
        "def f():\n    from rlactors.base import logging\n"
    )
    assert _imports(src, {"rlactors.api.cluster", "rlactors.base.logging"}) == {
        "rlactors.api.cluster",
        "rlactors.base.logging",
    }
