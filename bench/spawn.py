"""Actor start-up: workers forked from the node agent's fork server against workers exec'd, in one run.

    python bench/spawn.py              # 4 actors, 3 rounds of each way
    python bench/spawn.py --actors 8 --rounds 5

Each round starts a local cluster and spawns ``--actors`` actors of a class whose start-up imports
torch and transformers' model classes, as a trainer rank, an inference server or a rollout actor
does (``bench/spawn_actor.py``). The two ways alternate, round by round. The forked run sets
``RLACTORS_FORK_PACKAGES=bench`` (the fork server preloads the class's module and its
``FORK_PRELOAD``); the exec'd one sets it empty. Prints, per way, the median over rounds of:
seconds until every actor has answered its first call (spawned concurrently, as a group); CPU
seconds of the workers and the fork server (``/proc``, read before the cluster stops); and the
first actor's seconds (the fork server's own import is in it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.spawn_actor, by module path

import rlactors
from bench.spawn_actor import Heavy

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


async def one_round(n: int, forked: bool) -> tuple[float, float, float]:
    os.environ["RLACTORS_FORK_PACKAGES"] = "bench" if forked else ""
    async with rlactors.init() as cluster:
        t0 = time.perf_counter()
        first = await cluster.spawn(Heavy, name="heavy-0")
        await first.ready()
        t_first = time.perf_counter() - t0
        rest = await asyncio.gather(*(cluster.spawn(Heavy, name=f"heavy-{i}") for i in range(1, n)))
        await asyncio.gather(*(h.ready() for h in rest))
        t_all = time.perf_counter() - t0
        # the workers, and the fork server with them (they are its children): everything below us
        pids = children(os.getpid())
        pids += [c for p in pids for c in children(p)]
        cpu = sum(cpu_s(p) for p in pids)
    return t_all, cpu, t_first


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actors", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    got: dict[str, list[tuple[float, float, float]]] = {"forked": [], "exec'd": []}
    for _ in range(args.rounds):
        for way in got:
            got[way].append(await one_round(args.actors, way == "forked"))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}")
    print(f"{args.actors} actors importing torch + transformers, median of {args.rounds} rounds")
    print(f"{'':8} {'all ready s':>12} {'CPU s':>8} {'first s':>8}")
    for way, rows in got.items():
        med = [statistics.median(r[i] for r in rows) for i in range(3)]
        print(f"{way:8} {med[0]:12.2f} {med[1]:8.1f} {med[2]:8.2f}")


if __name__ == "__main__":
    asyncio.run(main())
