"""Fixtures for the SGLang-protocol conformance suite.

By default the suite starts the reference server (sim backend, the tiny checkpoint as its model
path) as a subprocess on 127.0.0.1. ``RLACTORS_CONFORMANCE_SGLANG=<python of SGLang's venv>``
starts real SGLang on CPU instead, with the launcher's flags (``scripts/test-sglang.sh`` does
this). ``RLACTORS_CONFORMANCE_URL`` runs it against any server already up that speaks SGLang's
protocol, with these optional variables:
``RLACTORS_CONFORMANCE_ALT_MODEL`` / ``RLACTORS_CONFORMANCE_MODEL`` (two checkpoint folders of the
served architecture, for the disk-update tests).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodes.inference.models import ensure_tiny_checkpoint
from tests.helpers.servers import serving, start_reference_server, start_sglang_server

REPO = Path(__file__).resolve().parents[2]
EXTERNAL_URL = os.environ.get("RLACTORS_CONFORMANCE_URL")
SGLANG_PYTHON = os.environ.get("RLACTORS_CONFORMANCE_SGLANG")
# both servers run with this many requests at most, so a test can make one wait in the queue
MAX_RUNNING = 4
# real SGLang launched without what the reference server lacks, so both refuse the same requests
# in the same words (its CPU install has the xgrammar backend and would serve regex and the like)
SGLANG_AS_REFERENCE = ["--grammar-backend", "none"]


@pytest.fixture(scope="session")
def tiny_ckpt() -> Path:
    """The tiny random Llama (seed 0), the reference server's model in this suite."""
    override = os.environ.get("RLACTORS_CONFORMANCE_MODEL")
    return Path(override) if override else ensure_tiny_checkpoint(seed=0, tied=False)


@pytest.fixture(scope="session")
def tiny_ckpt_alt() -> Path:
    """Same architecture, other weights (seed 1), for weight updates."""
    override = os.environ.get("RLACTORS_CONFORMANCE_ALT_MODEL")
    return Path(override) if override else ensure_tiny_checkpoint(seed=1, tied=False)


@pytest.fixture(scope="session")
def server_url(tiny_ckpt: Path) -> Iterator[str]:
    """URL of the server under test (external, or a sim reference server we start)."""
    if EXTERNAL_URL:
        yield EXTERNAL_URL.rstrip("/")
    elif SGLANG_PYTHON:
        yield from serving(
            start_sglang_server(
                SGLANG_PYTHON,
                str(tiny_ckpt),
                ["--max-running-requests", str(MAX_RUNNING), *SGLANG_AS_REFERENCE],
            )
        )
    else:
        yield from serving(
            start_reference_server(
                [
                    "--backend",
                    "sim",
                    "--model-path",
                    str(tiny_ckpt),
                    "--sim-decode-s-base",
                    "0.002",
                    "--max-running-requests",
                    str(MAX_RUNNING),
                ]
            )
        )


@pytest.fixture(scope="module")
def hf_url(tiny_ckpt: Path) -> Iterator[str]:
    """The reference server's hf backend on the tiny checkpoint (one per test module)."""
    yield from serving(
        start_reference_server(["--backend", "hf", "--model-path", str(tiny_ckpt), "--num-threads", "1"])
    )


@pytest.fixture(scope="session")
def is_reference() -> bool:
    """True when the server under test is our reference server."""
    return not (EXTERNAL_URL or SGLANG_PYTHON)


@pytest.fixture
async def client(server_url: str) -> Any:
    """An HTTP client bound to the server under test."""
    async with httpx.AsyncClient(base_url=server_url, timeout=120.0) as c:
        yield c
