"""Nothing of ours shadows a package a user may have installed, or the standard library.

Installing rlactors puts four top-level import names on every user's ``sys.path``: ``rlactors``,
``nodes``, ``protocols`` and ``recipes`` (the README says so). Running a script by its path
(``python recipes/gsm8k_grpo.py``, ``python bench/pool.py``) puts the script's folder first on
``sys.path``, so every module and package in that folder becomes a top-level name too, in that
process and in every actor it starts (they inherit ``sys.path``): a ``recipes/agents`` package once
hid openai-agents' ``agents``. Each name is compared with the top-level modules of the installed
distributions (``importlib.metadata.packages_distributions()``) and the standard library's.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"rlactors"}  # the distribution this repository installs
TOP_LEVEL = ("rlactors", "nodes", "protocols", "recipes")
# Folders of scripts run by path that live inside a package (found below: the others).
SCRIPT_FOLDERS_IN_PACKAGES = ("recipes",)
# Folders put on a server's PYTHONPATH on purpose, to stand in for a module of the same name:
# SGLang's CPU engine imports sgl_kernel (nodes/inference/sglang_cpu), and hold_sigterm's
# sitecustomize runs in every process of SGLang's, then hands over to the next sitecustomize.
STAND_INS = {"nodes/inference/sglang_cpu": {"sgl_kernel"}, "nodes/inference/hold_sigterm": {"sitecustomize"}}


def names_in(folder: Path) -> set[str]:
    """The top-level import names a folder on sys.path provides: its modules and packages. A folder
    without ``__init__.py`` is left out: a namespace package never hides a module found later."""
    modules = {p.stem for p in folder.glob("*.py")}
    packages = {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    return (modules | packages) - {"__init__", "__main__", "conftest"}


def clashes(names: set[str]) -> dict[str, list[str]]:
    """Each name some installed distribution other than ours provides (or the standard library)."""
    installed = packages_distributions()
    found = {}
    for name in sorted(names):
        others = sorted(set(installed.get(name, [])) - OURS)
        if name in sys.stdlib_module_names:
            others.append("the standard library")
        if others:
            found[name] = others
    return found


def script_folders() -> list[Path]:
    """Folders that go first on sys.path when one of their files is run by path: those of every
    tracked file with a ``__main__`` block outside a package, and SCRIPT_FOLDERS_IN_PACKAGES."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    folders = {ROOT / f for f in SCRIPT_FOLDERS_IN_PACKAGES}
    for f in tracked:
        path = ROOT / f
        if not (path.parent / "__init__.py").exists() and "__main__" in path.read_text(errors="replace"):
            folders.add(path.parent)
    return sorted(folders)


def test_the_installed_top_level_names_are_ours_alone() -> None:
    assert clashes(set(TOP_LEVEL)) == {}


def test_the_installed_top_level_names_are_what_pyproject_installs() -> None:
    """A new top-level package is a new name on every user's path: add it here (and to the README)."""
    text = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["rlactors*", "protocols*", "nodes*", "recipes*"]' in text


@pytest.mark.parametrize("folder", [*script_folders(), ROOT], ids=lambda p: str(p.relative_to(ROOT)) or ".")
def test_no_name_in_a_folder_on_sys_path_shadows_an_installed_one(folder: Path) -> None:
    assert clashes(names_in(folder)) == {}


@pytest.mark.parametrize("folder", sorted(STAND_INS))
def test_a_stand_in_folder_holds_only_its_stand_ins(folder: Path) -> None:
    assert names_in(ROOT / folder) == STAND_INS[folder]


def test_a_clash_is_found(tmp_path: Path) -> None:
    """recipes/agents as it was: with openai-agents installed, `agents` is theirs."""
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "__init__.py").write_text("")
    (tmp_path / "json.py").write_text("")
    found = clashes(names_in(tmp_path))
    assert found["json"] == ["the standard library"]
    if "agents" in packages_distributions():
        assert found["agents"]
