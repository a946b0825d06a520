"""Fixtures for rollout tests: a reference server (sim backend) shared per module, and scripted
servers on loopback sockets (``serve``, tests/rollout/scripted.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.servers import reference_server
from tests.rollout.scripted import serve  # noqa: F401 - the fixture


@pytest.fixture(scope="module")
def sim_server() -> Iterator[str]:
    """A sim reference server; 2 ms per decode step so episodes overlap and can be interrupted."""
    with reference_server(
        ["--backend", "sim", "--sim-decode-s-base", "0.002", "--sim-eos-prob", "0.05"]
    ) as url:
        yield url


@pytest.fixture(scope="module")
def slow_sim() -> Iterator[str]:
    """A sim server slow enough (20 ms a step, no EOS) to be paused in the middle of a completion."""
    args = [
        "--backend",
        "sim",
        "--sim-decode-s-base",
        "0.02",
        "--sim-eos-prob",
        "0",
        "--sim-vocab-size",
        "49152",
    ]
    with reference_server(args) as url:
        yield url
