"""Client sessions: a client the head gave up for silent learns what happened to its actors."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

import rlactors
from rlactors.base.aio import wait_for
from rlactors.wire.runtime import RuntimeClient
from tests.runtime.actors import Counter

ROOT = Path(__file__).resolve().parents[2]

# A driver that spawns an actor, then (when told on stdin) calls it and prints what happened.
DRIVER = """
import asyncio, sys
import rlactors
from rlactors.base.aio import wait_for
from tests.runtime.actors import Counter

async def main():
    cluster = await rlactors.connect()
    c = await cluster.spawn(Counter)
    print(c.actor_id, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    try:
        print("answered", await wait_for(c.add(1), 20), flush=True)
    except Exception as e:  # the test reads whatever the call raised
        print(type(e).__name__, e, flush=True)
    await cluster.close()

asyncio.run(main())
"""


async def test_a_driver_stopped_past_client_timeout_gets_actor_died_not_a_hang() -> None:
    async with rlactors.init(address="tcp://127.0.0.1:0", client_timeout=3) as cluster:
        env = {
            **os.environ,
            "RLACTORS_ADDRESS": cluster.address,
            "RLACTORS_SECRET_FILE": cluster.secret_file,
            "PYTHONPATH": str(ROOT),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            DRIVER,
            cwd=ROOT,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            actor_id = (await wait_for(proc.stdout.readline(), 60)).decode().strip()
            proc.send_signal(signal.SIGSTOP)
            # The head gives the silent driver up and stops the actor it owned.
            info = await wait_for(cluster.watch(actor_id), 60)
            assert info["state"] == "DEAD"
            proc.send_signal(signal.SIGCONT)
            proc.stdin.write(b"go\n")
            line = (await wait_for(proc.stdout.readline(), 60)).decode()
            assert line.startswith("ActorDiedError"), line
            assert "was silent for more than 3s" in line
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                await proc.wait()


async def test_a_client_whose_stream_end_was_lost_follows_events_again_after_a_heartbeat() -> None:
    async with rlactors.init(client_timeout=2) as cluster:
        victim = await cluster.spawn(Counter)
        other = RuntimeClient(cluster.address, cluster._local.head.security, name="other")
        await other.start()
        try:
            pending = other.call_actor(victim.actor_id, victim.address, "sleep", (60,), {})
            # The head gives `other` up, but the end of its event stream never reaches it
            # (as when the connection that carried it was dropped).
            sessions = cluster._local.head.sessions
            del sessions._seen[other.client_id]
            for q in [q for q, cid in sessions._subs.items() if cid == other.client_id]:
                del sessions._subs[q]
            await cluster.kill(victim)
            with pytest.raises(rlactors.ActorDiedError):
                await wait_for(pending, 10)
        finally:
            await other.close()
