"""Real SGLang 0.5.23 (CPU) started by the launcher is its owner's to stop (issue 39): every one of
its processes is in the server's own session (a signal to the job's process group does not reach
them), a SIGTERM sent to each of them (Slurm's way) is not acted on, it still serves, and its
owner's stop ends every one of them.

The server is the package's shared one (tests/sglang/conftest.py: ``exported_sglang``); this test
ends it, so it runs after the shared server's other users. The reference server holds a SIGTERM
too: tests/conformance/test_launcher_signals.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.processes import descendants, gone
from tests.sglang.conftest import STOPS_IT, ExportedServer
from tests.sglang.test_sglang_code import NEEDS_SGLANG

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.timeout(1500),  # the shared server's start-up on CPU when this test runs alone
    pytest.mark.asyncio(loop_scope="package"),  # the shared server's owner runs on the package's loop
    getattr(pytest.mark, STOPS_IT),
    NEEDS_SGLANG,
]

SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _status(path: Path) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in path.read_text().splitlines() if ":\t" in line)


def settled(pid: int) -> bool:
    """Whether the kernel has done what it will with a SIGTERM sent to ``pid``: the process has
    ended, or no SIGTERM is pending that one of its threads would take (pending and blocked in
    every thread is held: never acted on)."""
    try:
        shared = int(_status(Path(f"/proc/{pid}/status"))["ShdPnd"], 16) & SIGTERM_BIT
        threads = [_status(t / "status") for t in Path(f"/proc/{pid}/task").iterdir()]
    except (OSError, KeyError):
        return True  # ended
    for t in threads:
        blocked = int(t["SigBlk"], 16) & SIGTERM_BIT
        if not blocked and (shared or int(t["SigPnd"], 16) & SIGTERM_BIT):
            return False
    return True


def until_settled(pid: int, timeout: float = 60.0) -> bool:
    """Whether ``pid`` is :func:`settled` within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not settled(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)  # polling /proc: there is no event for another process's signal delivery
    return True


async def generate(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=300) as client:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
        return await client.post(url + "/generate", json=body)


async def test_sglang_holds_a_sigterm_to_each_process_and_its_owners_stop_ends_every_one(
    exported_sglang: ExportedServer,
) -> None:
    served = exported_sglang
    sup = served.sup
    assert sup.proc is not None and sup.proc.returncode is None, "the shared server was stopped earlier"
    try:
        pids = [sup.proc.pid, *descendants(sup.proc.pid)]
        # SGLang's scheduler and detokenizer beside its HTTP server
        assert len(pids) > 1, served.log.read_text()
        assert {os.getsid(p) for p in pids} == {sup.proc.pid} != {os.getsid(0)}
        for pid in pids:  # as Slurm signals every process of a step
            os.kill(pid, signal.SIGTERM)
        for pid in pids:  # a process whose SIGTERM was acted on by default has ended by then
            assert await asyncio.to_thread(until_settled, pid), f"a SIGTERM still pending in {pid}"
        assert [p for p in pids if gone(p, 0)] == [], served.log.read_text()[-3000:]
        r = await generate(served.url)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
        assert [p for p in pids if gone(p, 0)] == [], served.log.read_text()[-3000:]
    finally:
        await sup.stop()
    assert all(gone(pid) for pid in pids), [p for p in pids if not gone(p, 0)]
