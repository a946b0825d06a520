"""Every flag of the runtime's commands and of the inference server says what it does in --help."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [
    ["rlactors.launch.cli"],
    ["rlactors.launch.cli", "up"],
    ["rlactors.launch.cli", "status"],
    ["rlactors.launch.cli", "down"],
    ["rlactors.launch.cli", "secret"],
    ["rlactors.launch.daemons"],
    ["rlactors.launch.daemons", "head"],
    ["rlactors.launch.daemons", "agent"],
    ["nodes.inference.server"],
]


def entries_without_help(text: str) -> list[str]:
    """Flags and positionals of argparse's --help output that have no help text."""
    lines = text.splitlines()
    missing, in_section = [], False
    for i, line in enumerate(lines):
        if re.match(r"^\S.*:$", line):  # "options:", "positional arguments:"
            in_section = True
            continue
        m = re.match(r"^( {2}| {4})(\S.*?)(?: {2,}(\S.*))?$", line) if in_section else None
        if m is None or m.group(2).startswith("{"):  # {a,b}: the subcommands, listed below it
            continue
        indent, name, help_text = len(m.group(1)), m.group(2), m.group(3) or ""
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if not help_text and len(following) - len(following.lstrip()) > indent + 2:
            help_text = following.strip()  # a long flag: its help on the next line
        if not help_text or "no description" in help_text:
            missing.append(name)
    return missing


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_flag_has_a_help_text(command: list[str]) -> None:
    res = subprocess.run(
        [sys.executable, "-m", *command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"},
    )
    assert res.returncode == 0, res.stderr
    assert "options:" in res.stdout
    assert entries_without_help(res.stdout) == [], res.stdout


def test_the_checker_finds_a_flag_without_help() -> None:
    text = "usage: x\n\noptions:\n  -h, --help  show this help\n  --bare BARE\n  --ok OK      fine\n"
    assert entries_without_help(text) == ["--bare BARE"]
