"""Shared fixtures. Every test that starts processes cleans them up."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Keep torch (when a test imports it) to one thread per process on this small machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
async def cluster() -> AsyncIterator[object]:
    """An embedded local cluster on the test's event loop."""
    import rlactors

    async with rlactors.init() as c:
        yield c
