"""The generated reference pages are current: a change to a command's flags or to the metrics
glossary without regenerating its page fails here (and in .ci/run's strict docs build)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["gen-cli-reference", "gen-metrics-reference"])
def test_generated_page_is_current(name: str) -> None:
    gen = _script(name)
    assert gen.OUT.read_text() == gen.reference(), f"{gen.OUT} is stale: run python scripts/{name}.py"


def test_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "metrics.md"
    stale.write_text("# Metrics\n")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen-metrics-reference.py"), "--check", "--path", str(stale)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "is stale" in done.stderr


def test_cli_reference_lists_every_flag_of_every_command() -> None:
    """Each command's every option string is on the page (the page is made from the parsers)."""
    gen = _script("gen-cli-reference")
    page = gen.OUT.read_text()
    seen = 0
    for _, module, call in gen.COMMANDS:
        parsers = [gen.capture(module, call)]
        while parsers:
            parser = parsers.pop()
            for action in parser._actions:
                for flag in action.option_strings:
                    if flag not in ("-h", "--help"):
                        assert flag in page, f"{module}: {flag} is not in docs/reference/cli.md"
                        seen += 1
                if isinstance(getattr(action, "choices", None), dict):
                    parsers += list(action.choices.values())
    assert seen > 50
