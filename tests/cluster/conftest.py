"""Fixtures of the cluster tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    """The environment for `rlactors` commands of one test: its own state folder, wide output."""
    return {
        **os.environ,
        "RLACTORS_STATE_DIR": str(tmp_path / "state"),
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
    }
