"""mypy with the handle plugin over rlactors, protocols, nodes and recipes, as pyproject.toml's
``[tool.mypy]`` sets it up: the code must type-check. ``python -m mypy`` with no arguments runs the
same check; this test puts it in the suite's command line (and so in CI)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy is in the dev extra: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[2]
# Kept between runs (runs/ is git-ignored): a warm cache checks in seconds, a cold one takes minutes
CACHE = ROOT / "runs" / "mypy-cache"
PACKAGES = ["rlactors", "protocols", "nodes", "recipes"]


def test_the_configuration_checks_the_four_packages_with_the_plugin() -> None:
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert mypy["plugins"] == ["rlactors.mypy"]
    assert sorted(mypy["packages"]) == sorted(PACKAGES)


@pytest.mark.slow  # a cold cache (a fresh clone) analyses torch's and transformers' stubs too
@pytest.mark.timeout(600)
def test_the_packages_type_check() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(CACHE)],
        cwd=ROOT,  # mypy finds the packages from here (an editable install's import hook hides them)
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checked = re.search(r"no issues found in (\d+) source files", proc.stdout)
    assert checked and int(checked[1]) >= 100, proc.stdout  # every module of the four, not a few
