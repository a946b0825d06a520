"""A driver of a run on an `rlactors up` cluster (``RLACTORS_STATE_DIR`` names it), for the tests of
how a run ends. Its run: an actor ``pool`` (control credential) that spawns ``server-0`` itself, and
an actor ``victim``. Prints ``ready <victim pid>``, then ends as ``mode`` says:

- ``done``: reads one line on stdin, then leaves;
- ``error``: reads one line, then raises (exit 1);
- ``signal``: waits for SIGTERM (finishes, exit 143) or SIGINT (Ctrl-C: exit 130);
- ``spawn``: spawns nothing but a ``pool`` of its own, and prints the error it gets (exit 2);
- ``block``: reads one line, calls ``victim.nap`` (3 s: its loop notes the call pending at least
  once), prints ``blocking`` and blocks its event loop for that many seconds (synchronous code, as
  a driver's own work can), prints ``alive <victim pid>`` if its actors still answer, then reads
  one more line and leaves.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import rlactors


class Pool(rlactors.Actor):
    """Spawns an actor of the run itself, as an inference pool spawns its servers."""

    async def launch(self) -> str:
        server = await rlactors.get_context().cluster.spawn(Leaf, name="server-0")
        return server.actor_id


class Leaf(rlactors.Actor):
    async def pid(self) -> int:
        return os.getpid()

    async def nap(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def main(mode: str) -> int:
    loop = asyncio.get_running_loop()
    cluster = await rlactors.connect(timeout=30)
    async with cluster:
        if mode == "spawn":
            try:
                await cluster.spawn(Pool, name="pool", control=True)
            except ValueError as e:
                print(f"error: {e}", flush=True)
                return 2
            return 0
        pool = await cluster.spawn(Pool, name="pool", control=True)
        await pool.launch()
        victim = await cluster.spawn(Leaf, name="victim")
        print("ready", await victim.pid(), flush=True)
        if mode == "signal":
            got: asyncio.Future[int] = loop.create_future()
            loop.add_signal_handler(signal.SIGTERM, lambda: got.done() or got.set_result(143))
            return await got  # SIGINT: KeyboardInterrupt, through this `async with`
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if mode == "block":
            await victim.nap(3.0)  # longer than the 2 s between the loop's notes of its calls
            print("blocking", flush=True)
            time.sleep(float(line))  # noqa: ASYNC251 - the point: the loop is blocked, no task runs
            print("alive", await victim.pid(), flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)  # the test looks at the run meanwhile
            return 0
        if mode == "error":
            raise RuntimeError("the run failed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main(sys.argv[1])))
    except KeyboardInterrupt:
        sys.exit(130)
