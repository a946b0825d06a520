"""A hung worker (SIGSTOP: silent, but its process lives): fenced and replaced when it has restarts
left, left alone (it answers again once woken) when it has none."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import rlactors
from rlactors.base.aio import wait_for
from rlactors.wire.runtime import current_client
from rlactors.wire.transport import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS
from tests.runtime.actors import Counter

NODE_TIMEOUT = 1.0
FENCE_AFTER = NODE_TIMEOUT + HEARTBEAT_TIMEOUT_MS / 1000  # the head's default bound
DETECT = (HEARTBEAT_IVL_MS + HEARTBEAT_TIMEOUT_MS) / 1000  # a ping goes unanswered: the connection is cut


@pytest.fixture
async def cluster() -> AsyncIterator[rlactors.Cluster]:
    async with rlactors.init(node_timeout=NODE_TIMEOUT) as c:
        yield c


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


async def test_a_stopped_worker_with_restarts_left_is_killed_and_replaced(cluster: rlactors.Cluster) -> None:
    c = await cluster.spawn(Counter, 10, name="hung", max_restarts=1)
    assert await c.add(1) == 11
    pid = await c.pid()
    pending = c.sleep(60)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        death = await wait_for(cluster.watch(c), FENCE_AFTER + DETECT + 10)
        fenced_after = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):  # wakes it if the test failed
            os.kill(pid, signal.SIGCONT)
    assert death["restarting"], death
    assert "stopped answering" in death["reason"] and "SIGKILL" in death["reason"], death
    # Not before the bound: a silent worker gets fence_after seconds (plus a heartbeat's slack).
    assert FENCE_AFTER - 0.5 <= fenced_after <= FENCE_AFTER + DETECT, fenced_after
    with pytest.raises(rlactors.ActorDiedError):  # the call it was running is lost, as after kill -9
        await wait_for(pending, 10)
    assert _gone(pid)  # SIGKILL ended the stopped process, and it was reaped
    # The next incarnation answers (constructor re-run), under the same handle.
    assert await wait_for(c.value(), 60) == 10
    assert await c.pid() != pid
    info = next(a for a in await cluster.actors() if a["actor_id"] == c.actor_id)
    assert info["restarts"] == 1 and info["state"] == "ALIVE"


async def test_a_stopped_worker_without_restarts_is_left_to_wake_up(cluster: rlactors.Cluster) -> None:
    c = await cluster.spawn(Counter, 10, name="sleeper")
    pid = await c.pid()
    pending = c.add(1)
    await pending
    pending = c.sleep(60)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(rlactors.ActorUnreachableError):
            await wait_for(pending, DETECT + 10)
        # Time itself is what is tested here: let the bound pass, with a margin.
        await asyncio.sleep(max(0.0, FENCE_AFTER + 2 - (time.monotonic() - t0)))
        assert not _gone(pid)  # not killed: nothing could take its place
        info = next(a for a in await cluster.actors() if a["actor_id"] == c.actor_id)
        assert info["state"] == "ALIVE" and info["pid"] == pid
    finally:
        os.kill(pid, signal.SIGCONT)
    await wait_for(current_client().wait_reachable(c.actor_id, 30), 35)
    assert await c.value() == 11  # the same incarnation, state kept


async def test_a_caller_that_found_it_unreachable_waits_for_the_new_incarnation() -> None:
    # Default bounds: callers give up on the silent worker (about 10 s) before its agent kills it
    # (fence_after = node_timeout 5 s + 6 s), as RolloutHandle sees it.
    async with rlactors.init() as cluster:
        c = await cluster.spawn(Counter, 10, name="slow-hung", max_restarts=1)
        pid = await c.pid()
        pending = c.sleep(60)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(rlactors.ActorUnreachableError):
                await wait_for(pending, DETECT + 10)
            with pytest.raises(rlactors.ActorUnreachableError):  # until it is back or replaced: at once
                await c.value()
            await wait_for(current_client().wait_reachable(c.actor_id, 60), 65)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert _gone(pid)
        assert await wait_for(c.value(), 30) == 10
        assert await c.pid() != pid
