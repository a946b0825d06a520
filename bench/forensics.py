"""How long ``cluster.stacks()`` takes over 100 actors, a few of them busy (target: <= 5 s).

    python bench/forensics.py [--actors 100] [--rounds 5]

An embedded cluster with N actors: two in a wait cycle (one with max_concurrency=1), two sleeping
in a sync method, one whose loop is stuck in a CPU-bound coroutine (so the report waits for its
answer, gives up, and collects its stacks by signal), the rest idle. Times the report first with
every loop answering, then with the stuck one, and checks that it names the cycle and the stuck loop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from typing import Any

import rlactors


class Idle(rlactors.Actor):
    async def ping(self) -> str:
        return "pong"

    def nap(self, seconds: float) -> None:
        time.sleep(seconds)

    async def spin(self, seconds: float) -> None:
        t = time.time() + seconds
        while time.time() < t:
            pass


class Ping(rlactors.Actor):
    def __init__(self) -> None:
        self.peer: Any = None

    async def set_peer(self, peer: Any) -> None:
        self.peer = peer

    async def f(self) -> str:
        return await self.peer.g()

    async def h(self) -> str:
        return "h"


class Pong(rlactors.Actor):
    def __init__(self, peer: Any) -> None:
        self.peer = peer

    async def g(self) -> str:
        return await self.peer.h()


async def main(n: int, rounds: int) -> None:
    async with rlactors.init(resources={"cpu": float(n + 10)}) as cluster:
        t0 = time.monotonic()
        sem = asyncio.Semaphore(8)  # two cores: start workers a few at a time

        async def spawn(i: int) -> Any:
            async with sem:
                return await cluster.spawn(Idle, name=f"idle-{i}", resources={"cpu": 1})

        idle = await asyncio.gather(*(spawn(i) for i in range(n - 2)))
        a = await cluster.spawn(Ping, name="cycle-a", max_concurrency=1, resources={"cpu": 1})
        b = await cluster.spawn(Pong, a, name="cycle-b", resources={"cpu": 1})
        await a.set_peer(b)
        print(f"{n} actors up in {time.monotonic() - t0:.1f} s")
        busy = [a.f.submit(), idle[0].nap.submit(600), idle[1].nap.submit(600)]
        for label, stuck in (("every loop answering", False), ("one loop stuck", True)):
            if stuck:
                busy.append(idle[2].spin.submit(600))
            times = []
            report = None
            for _ in range(rounds):
                t = time.monotonic()
                report = await cluster.stacks(timeout_s=5.0)
                times.append(time.monotonic() - t)
            assert report is not None and [c.actors for c in report.cycles] == [["cycle-a", "cycle-b"]]
            assert [x.name for x in report.unresponsive] == (["idle-2"] if stuck else [])
            print(
                f"{label}: report over {len(report.actors)} entries in median {statistics.median(times):.2f} s, "
                f"max {max(times):.2f} s ({rounds} rounds; target <= 5 s)"
            )
        assert report is not None
        print(f"  the stuck loop: {report['idle-2'].summary()}")
        print(f"  a sleeper: {report['idle-0'].summary()}")
        print(f"  the cycle: {report.cycles[0]}")
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
        for f in busy:
            f.cancel()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actors", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    asyncio.run(main(args.actors, args.rounds))
