"""Helpers for tests and benchmarks that need a running reference server.

Blocking helpers (:func:`start_reference_server`, :func:`stop_server`, :func:`reference_server`)
are for fixtures and scripts; the async ones poll a server's ``/get_load`` for conditions, with
a timeout, instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx

from nodes.inference.launcher import REPO_ROOT, free_port


def start_reference_server(args: list[str], timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start ``python -m nodes.inference.server`` with ``args`` on a free port; wait until healthy."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=f"rlactors-server-{port}-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "nodes.inference.server", "--host", "127.0.0.1", "--port", str(port), *args],
        cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.close()
                text = Path(log.name).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"server exited with {proc.returncode}:\n{text}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url + "/health_generate").status_code == 200:
                    proc._rl_log = log  # type: ignore[attr-defined]
                    return proc, url
            time.sleep(0.2)  # start-up poll interval
    stop_server(proc)
    raise RuntimeError(f"server on port {port} not healthy after {timeout_s} s")


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate (then kill) a server started by :func:`start_reference_server`."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    log = getattr(proc, "_rl_log", None)
    if log is not None:
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


@contextlib.contextmanager
def reference_server(args: list[str], timeout_s: float = 120.0) -> Iterator[str]:
    """Run a reference server for the duration of a ``with`` block; yields its URL."""
    proc, url = start_reference_server(args, timeout_s)
    try:
        yield url
    finally:
        stop_server(proc)


async def wait_until(pred: Callable[[], Awaitable[bool]], timeout_s: float = 30.0, what: str = "") -> None:
    """Poll ``pred`` until true (a condition wait, bounded by ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or pred}")


async def load(client: httpx.AsyncClient) -> tuple[int, int]:
    """(running, waiting) request counts from ``/get_load``."""
    r = await client.get("/get_load")
    r.raise_for_status()
    entries = r.json()
    entries = entries if isinstance(entries, list) else [entries]
    total = sum(e.get("num_reqs", 0) for e in entries)
    waiting = sum(e.get("num_waiting_reqs", 0) for e in entries)
    return total - waiting, waiting


async def wait_load(client: httpx.AsyncClient, running: int | None = None, waiting: int | None = None) -> None:
    """Wait until the server reports the given running/waiting counts."""
    async def ok() -> bool:
        r, w = await load(client)
        return (running is None or r == running) and (waiting is None or w == waiting)

    await wait_until(ok, what=f"running={running} waiting={waiting}")
