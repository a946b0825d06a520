"""Typed handles, checked by mypy with the rlactors.mypy plugin: handles_ok.py must type-check
(its assert_type lines state what a checker infers), and every line of handles_bad.py marked
``# error: CODE`` must be reported with that code — and nothing else."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy is in the dev extra: pip install -e '.[dev]'")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # mypy finds rlactors from here (an editable install's import hook hides it)
REPORTED = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")
EXPECTED = re.compile(r"#\s*error:\s*(?P<code>[a-z-]+)")
# Kept between runs, as test_packages.py's (runs/ is git-ignored), and apart from it: mypy.ini's options
# differ, and one cache written under both is analysed again by each
CACHE = ROOT / "runs" / "mypy-cache-typing"


def run_mypy(*files: str) -> list[tuple[str, int, str]]:
    """mypy's errors on ``files`` (in this folder) as (file, line, code)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", HERE / "mypy.ini", "--cache-dir", CACHE]
        + [HERE / f for f in files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    errors = [
        (Path(m["file"]).name, int(m["line"]), m["code"])
        for m in map(REPORTED.match, proc.stdout.splitlines())
        if m
    ]
    assert proc.returncode in (0, 1) and (proc.returncode == 0) == (not errors), proc.stdout + proc.stderr
    return errors


def expected_errors(file: str) -> list[tuple[str, int, str]]:
    lines = (HERE / file).read_text().splitlines()
    return [(file, i, m["code"]) for i, line in enumerate(lines, 1) if (m := EXPECTED.search(line))]


def test_typed_calls_type_check_with_the_inferred_types() -> None:
    assert run_mypy("handles_ok.py") == []


def test_wrong_calls_are_reported_where_marked() -> None:
    expected = expected_errors("handles_bad.py")
    assert len(expected) >= 10
    assert sorted(run_mypy("handles_bad.py")) == sorted(expected)
