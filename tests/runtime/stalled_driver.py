"""A driver with an embedded cluster (the head on its own loop) and one actor, for the stall tests.

Prints ``ready <worker pid>`` once the actor answers; then, for every line read on stdin, calls
the actor and prints ``ok <result>`` or ``error <exception>``. Arguments: node_timeout, client_timeout.
"""

from __future__ import annotations

import asyncio
import sys

import rlactors
from tests.runtime.actors import Counter


async def main(node_timeout: float, client_timeout: float) -> None:
    loop = asyncio.get_running_loop()
    async with rlactors.init(node_timeout=node_timeout, client_timeout=client_timeout) as cluster:
        counter = await cluster.spawn(Counter)
        print("ready", await counter.pid(), flush=True)
        while await loop.run_in_executor(None, sys.stdin.readline):
            try:
                print("ok", await counter.add(1), flush=True)
            except Exception as e:  # the test reads whatever the call raised
                print("error", repr(e), flush=True)


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1]), float(sys.argv[2])))
