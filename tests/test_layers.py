"""The code stands in layers, and imports only go down them.

Top level: recipes → nodes → rlactors → protocols. Inside each, the sub-packages have an order
(:data:`LAYERS`): a module imports its own sub-package or one in a lower layer, never one beside it
in the same layer (the RL roles do not import each other) and never one above. And no circle, at
the level of files or of sub-packages.

Every import counts: at module level, under ``if TYPE_CHECKING:``, inside functions (a deferred
import is still a dependency: deferring it only hides a circle from the interpreter), and a module
named by a literal to ``importlib.import_module`` (the fork server's preload of the worker).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("recipes", "nodes", "rlactors", "protocols")  # each imports only those after it

# Inside a top-level package: its units (sub-packages, or modules at its root) by layer, lowest
# first. A unit imports its own files and units of lower layers. The package's __init__ is above
# them all (rlactors/__init__.py re-exports the public API); nothing inside imports it.
LAYERS: dict[str, list[set[str]]] = {
    "protocols": [{"runtime"}, {"http", "rl"}],
    "rlactors": [{"base"}, {"wire"}, {"api", "head"}, {"node"}, {"launch", "mypy"}],
    "nodes": [{"common"}, {"plane", "inference", "rollout", "trainer"}, {"driver"}],
    # one readable file per recipe: no layers, but no circle either (checked for every package)
    "recipes": [{"sdk_agents", "toy_envs"}, {"gsm8k_config"}, {"gsm8k_plane"}, {"gsm8k_grpo", "gsm8k_eval"}],
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports, by any import statement anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, up level - 1
                package = (
                    module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
                )
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from rlactors.base import logging` imports the module rlactors.base.logging
            names = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules] or [base]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


@functools.cache  # every test reads the same tree: parse it once
def import_graph(packages: tuple[str, ...] = TOP) -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))}
    modules = set(files)
    return {name: imports(path, modules) - {name} for name, path in files.items()}


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


def unit(module: str) -> str:
    """``rlactors.node.worker`` → ``rlactors.node``; a package's own __init__ → the package."""
    parts = module.split(".")
    return ".".join(parts[:2])


def rank(u: str) -> tuple[int, int]:
    """(top-level rank, layer inside it); a package root (its __init__) is above its layers."""
    top, _, sub = u.partition(".")
    inner = LAYERS[top]
    layers = [i for i, units in enumerate(inner) if sub in units] if sub else [len(inner)]
    if not layers:
        raise LookupError(f"{u} has no layer: add it to LAYERS in {Path(__file__).name}")
    return (len(TOP) - TOP.index(top), layers[0])


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for m, deps in graph.items():
        units.setdefault(unit(m), set()).update(unit(d) for d in deps if unit(d) != unit(m))
    return units


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if unit(d) == unit(m):
                continue
            if rank(unit(d)) >= rank(unit(m)):  # above, or beside in the same layer
                bad.append(f"{m} → {d}")
    return bad


def test_every_unit_has_a_layer() -> None:
    """A new sub-package or root module is given its place in LAYERS (rank raises otherwise)."""
    unplaced = []
    for u in unit_graph(import_graph()):
        try:
            rank(u)
        except LookupError:
            unplaced.append(u)
    assert not unplaced, f"add these to LAYERS in {Path(__file__).name}: {unplaced}"


def test_no_import_circle_between_files() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " → ".join(cycle or [])


def test_no_import_circle_between_sub_packages() -> None:
    cycle = find_cycle(unit_graph(import_graph()))
    assert cycle is None, "import circle between sub-packages: " + " → ".join(cycle or [])


def test_imports_only_go_down() -> None:
    bad = upward_imports(import_graph())
    assert not bad, "imports up or sideways across layers (see LAYERS):\n" + "\n".join(bad)


def test_nothing_inside_imports_the_package_root() -> None:
    """rlactors/__init__.py re-exports the public API from every layer: importing it from inside
    would close a circle through it."""
    graph = import_graph()
    assert not [m for m, deps in graph.items() if m.startswith("rlactors.") and "rlactors" in deps]


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_find_cycle_finds_a_circle(graph: dict[str, set[str]], expected: list[str] | None) -> None:
    assert find_cycle(graph) == expected


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rlactors.api.cluster import Cluster\n"
        "def f():\n    from rlactors.base import logging\n"
        "def g():\n    importlib.import_module('rlactors.node.worker')\n"
    )
    known = {"rlactors.api.cluster", "rlactors.base.logging", "rlactors.node.worker", "rlactors.wire.client"}
    assert imports(src, known) == known - {"rlactors.wire.client"}


def test_an_upward_or_sideways_import_is_caught() -> None:
    graph = {
        "rlactors.base.errors": {"rlactors.api.cluster"},  # up
        "nodes.rollout.client": {"nodes.inference.settings"},  # beside: two roles
        "nodes.driver.evaluator": {"nodes.rollout.client", "protocols.rl"},  # down: fine
        "protocols.runtime.codec": {"rlactors.base.errors"},  # up a top-level package
    }
    assert upward_imports(graph) == [
        "nodes.rollout.client → nodes.inference.settings",
        "protocols.runtime.codec → rlactors.base.errors",
        "rlactors.base.errors → rlactors.api.cluster",
    ]
