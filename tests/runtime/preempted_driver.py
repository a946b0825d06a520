"""A driver with an embedded cluster and one actor, for the preemption tests.

Prints ``ready <worker pid>`` once the actor answers, then waits for SIGTERM or SIGINT (its own, or
its process group's). On the signal it calls the actor once more and prints ``after <signal> ok
<result>`` (the actor must still be there: stopping it is the driver's decision), and whether the
actor's ``on_stop`` had run by then; then it leaves the cluster, which stops the actor (its
``on_stop`` writes the file named by the argument), and exits 143 (SIGTERM) or 130 (SIGINT).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import rlactors


class Marked(rlactors.Actor):
    """An actor whose ``on_stop`` hook leaves a file behind."""

    def __init__(self, marker: str) -> None:
        self.marker, self.calls = Path(marker), 0

    async def add(self) -> int:
        self.calls += 1
        return self.calls

    async def pid(self) -> int:
        return os.getpid()

    async def on_stop(self) -> None:
        self.marker.write_text("stopped\n")


async def main(marker: Path) -> int:
    loop = asyncio.get_running_loop()
    got: asyncio.Future[signal.Signals] = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: got.done() or got.set_result(s))
    async with rlactors.init() as cluster:
        actor = await cluster.spawn(Marked, str(marker))
        await actor.add()
        print("ready", await actor.pid(), flush=True)
        sig = await got
        print(f"after {sig.name} ok {await actor.add()}", flush=True)
        stopped = await asyncio.to_thread(marker.exists)
        print("on_stop had run" if stopped else "on_stop not yet run", flush=True)
    return 143 if sig == signal.SIGTERM else 130


if __name__ == "__main__":
    sys.exit(asyncio.run(main(Path(sys.argv[1]))))
