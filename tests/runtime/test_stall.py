"""A stalled judge kills nothing: silence is counted only over time the judge was awake.

The driver of an embedded cluster runs the head and the node agent on its own loop; stopped for
longer than ``node_timeout`` and ``client_timeout``, on waking it used to find every node and
client "silent" (because it was not listening) and declare its healthy actors dead.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlactors.base.aio import wait_for
from rlactors.base.awake import SLACK_S, TICK_S, AwakeClock, awake_clock

ROOT = Path(__file__).resolve().parents[2]
NODE_TIMEOUT = 2.5  # the stop below (3x) also outlasts the transport's 6 s silence timeout (its pings)


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the driver exited with {proc.wait()}"
    return line.strip()


def test_a_stopped_driver_wakes_to_every_actor_answering() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/runtime/stalled_driver.py"), str(NODE_TIMEOUT), str(NODE_TIMEOUT)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    try:
        ready, worker = _line(proc).split()
        assert ready == "ready"
        proc.send_signal(signal.SIGSTOP)
        time.sleep(3 * NODE_TIMEOUT)  # the scenario itself: the judge is not running
        os.kill(int(worker), 0)  # the worker lived through it
        proc.send_signal(signal.SIGCONT)
        for expected in (1, 2, 3):  # at once, and still after the node's and client's deadlines
            proc.stdin.write("call\n")
            proc.stdin.flush()
            assert _line(proc) == f"ok {expected}"
            time.sleep(NODE_TIMEOUT / 2)
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        proc.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_awake_time_stands_still_while_the_loop_is_blocked() -> None:
    clock = AwakeClock()
    clock.start(asyncio.get_running_loop())
    t0 = clock.now()
    time.sleep(1.0)  # noqa: ASYNC251  # the stall under test
    assert clock.now() - t0 < TICK_S + SLACK_S + 0.05  # seen even before the late tick runs
    await asyncio.sleep(2 * TICK_S)
    assert clock.stalled_s > 1.0 - TICK_S - SLACK_S
    fired = asyncio.Event()
    t1 = time.monotonic()
    awake_clock().call_later(1.0, fired.set)
    time.sleep(1.2)  # noqa: ASYNC251  # a stall longer than the timer: it is extended, not fired
    await asyncio.sleep(0.2)
    assert not fired.is_set()
    await wait_for(fired.wait(), 3)
    assert time.monotonic() - t1 >= 1.2 + 1.0 - TICK_S - 0.05


async def test_the_embedded_clusters_own_node_and_driver_are_never_declared_silent() -> None:
    """An embedded cluster's head, node agent and driver are one process: their heartbeats late
    there mean that process is short of CPU (a busy or niced machine: a run of the recipe was
    stopped so, its node "silent" 5.7 s), never a node or a client lost. With every beat of both
    stopped past four deadlines, the node stays alive and the actor answers."""
    import rlactors
    from tests.runtime.actors import Counter

    async with rlactors.init(node_timeout=0.5, client_timeout=0.5) as c:
        counter = await c.spawn(Counter)
        assert await counter.add(1) == 1
        local = c._local
        assert local is not None
        local.agent._heartbeat.cancel()  # the node's beats
        await asyncio.to_thread(c._client._beats.stop)  # the driver's
        await asyncio.sleep(2.0)  # the scenario: the deadlines pass with no beat
        assert [n["alive"] for n in await c.nodes()] == [True]
        assert await counter.add(1) == 2
