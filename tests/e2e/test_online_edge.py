"""The protocol-edge checks (tests/rollout/http_edge.py) against the session API and the
OpenAI-compatible endpoint of a real online-mode run: the recipe with ``[data] source = "online"``,
its HTTP limits set by the config (``rollout.workflow_args.http.*``: short deadlines, a small
connection cap), served by its rollout actor's process. Every bound at its edge and every smuggling
shape, on raw sockets; the run serves legitimate requests throughout and is stopped at the end.

One run for the module (``run.steps = 0``: it waits for sessions until stopped; no check opens one).
The connection cap's check runs last: it holds the cap's connections."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.e2e.test_online import ARGS, _read_until
from tests.e2e.test_recipe import RECIPE, ROOT
from tests.rollout import http_edge as edge

RUN = [*(a for a in ARGS if not a.startswith("run.steps=")), "run.steps=0", *edge.EDGE_OVERRIDES]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[edge.Target]:
    out = tmp_path_factory.mktemp("online-edge") / "run"
    proc = subprocess.Popen(
        [sys.executable, str(RECIPE), *RUN, f"run.out_dir={out}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    seen: list[str] = []
    try:
        _read_until(proc, "online: sessions at", seen)
        assert proc.stdout is not None
        # the rest of its output is read (and kept) so that the pipe never fills and blocks the run
        threading.Thread(target=lambda: seen.extend(proc.stdout or []), daemon=True).start()
        info = json.loads((out / "sessions.json").read_text())
        url = urlsplit(info["urls"][0])
        assert url.hostname is not None and url.port is not None
        yield edge.Target(url.hostname, url.port, info["api_key"], edge.EDGE_LIMITS)
        assert proc.poll() is None, "the run ended while its API was probed:\n" + "".join(seen)[-5000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def test_head_size_at_its_edge(target: edge.Target) -> None:
    await edge.check_head_size(target)


async def test_request_line_at_its_edge(target: edge.Target) -> None:
    await edge.check_request_line(target)


async def test_header_count_at_its_edge(target: edge.Target) -> None:
    await edge.check_header_count(target)


async def test_a_trickled_head_is_closed_and_delays_no_one(target: edge.Target) -> None:
    await edge.check_slow_head(target)


async def test_a_stalled_body_is_closed(target: edge.Target) -> None:
    await edge.check_slow_body(target)


async def test_an_idle_connection_is_closed(target: edge.Target) -> None:
    await edge.check_idle(target)


async def test_the_key_is_checked_before_the_body_is_read(target: edge.Target) -> None:
    await edge.check_key_before_body(target)


async def test_pipelined_requests_past_the_bound_are_not_read(target: edge.Target) -> None:
    await edge.check_pipelining(target)


@pytest.mark.parametrize("raw, status", [c[1:] for c in edge.SMUGGLING], ids=[c[0] for c in edge.SMUGGLING])
async def test_smuggling_shapes_are_refused_and_closed(target: edge.Target, raw: bytes, status: int) -> None:
    await edge.check_smuggling(target, raw, status)


async def test_past_the_connection_cap_new_ones_get_503_open_ones_are_served(target: edge.Target) -> None:
    await edge.check_connection_cap(target)
