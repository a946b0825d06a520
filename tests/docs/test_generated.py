"""The generated reference pages are current: a change to a command's flags or to the metrics
glossary without regenerating its page fails here (and in .ci/run's strict docs build)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["gen-cli-reference.py", "gen-metrics-reference.py"])
def test_generated_page_is_current(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{done.stderr.strip()} (scripts/{script})"


def test_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "cli.md"
    stale.write_text("# Command lines\n")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen-cli-reference.py"), "--check", "--path", str(stale)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "is stale" in done.stderr


def test_cli_reference_lists_every_flag_of_every_command() -> None:
    """Each command's every option string is on the page (the page is made from the parsers)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gen_cli_reference", ROOT / "scripts" / "gen-cli-reference.py"
    )
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
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
                if hasattr(action, "choices") and isinstance(action.choices, dict):
                    parsers += list(action.choices.values())
    assert seen > 50
