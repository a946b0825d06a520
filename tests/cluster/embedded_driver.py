"""An embedded run (``rlactors.init()``, the recipe's default) that records itself in the run folder
``argv[1]``: spawns an actor ``counter``, prints ``ready``, and ends when its stdin closes."""

from __future__ import annotations

import asyncio
import sys

import rlactors
from tests.runtime.actors import Counter


async def main(run_dir: str) -> None:
    async with rlactors.init() as cluster:
        await cluster.spawn(Counter, 1, name="counter")
        print("ready", cluster.record_run(run_dir), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
