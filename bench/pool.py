"""The inference pool's weight-update group (#24): what a push costs against the number of servers,
and what a server joining costs the servers already serving.

The design measured: joins and leaves take effect at the next publish, where the weight-update
group is re-formed with the new members before anything pauses, and the push that follows gives a
joiner the current weights. The servers' pause is the push itself (pause, send, continue).

1. Push time (PolicySync.publish, trainer rank -> N reference servers, one broadcast group) for
   N = 1, 2, 4.
2. The pause a join costs: two servers serve a stream of short /generate requests; we record when
   each answer arrives. During a normal publish and during a publish that takes in a joiner, the
   longest gap between answers on each serving server is the time it did not serve. The join
   costs them what the re-formed group adds to that gap.

    python bench/pool.py                    # the tiny random model (quick)
    python bench/pool.py --model smollm2    # SmolLM2-135M (517 MB of weights)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import time

import httpx

import rlactors
from nodes.driver.policy_sync import PolicySync
from nodes.inference.launcher import ReferenceServerConfig
from nodes.inference.models import ensure_smollm2_checkpoint, ensure_tiny_checkpoint
from nodes.inference.pool import POOL_NAME, InferencePool, PoolConfig
from nodes.trainer.config import PushConfig, TrainConfig
from nodes.trainer.rank import TrainerRank


async def stream(url: str, stop: asyncio.Event, arrivals: list[float]) -> None:
    """Short requests to ``url``, four at a time, until ``stop``; each answer's arrival time."""
    async with httpx.AsyncClient(timeout=120) as http:

        async def one() -> None:
            while not stop.is_set():
                body = {
                    "input_ids": [1, 2, 3, 4],
                    "sampling_params": {"max_new_tokens": 4, "temperature": 1.0},
                }
                with contextlib.suppress(httpx.HTTPError):
                    r = await http.post(f"{url}/generate", json=body)
                    if r.status_code == 200:
                        arrivals.append(time.perf_counter())

        await asyncio.gather(*(one() for _ in range(4)))


def longest_gap(arrivals: list[float], start: float, end: float) -> float:
    """The longest time without an answer within [start, end] (its edges count as answers' ends)."""
    times = [start, *sorted(t for t in arrivals if start < t < end), end]
    return max(b - a for a, b in itertools.pairwise(times))


async def timed_publish(sync: PolicySync, version: int, urls: list[str]) -> dict[str, float]:
    """One publish while ``urls`` serve a stream; the publish's time, its push's, and the longest
    gap between answers on any of ``urls`` during it."""
    stop = asyncio.Event()
    arrivals: dict[str, list[float]] = {u: [] for u in urls}
    tasks = [asyncio.create_task(stream(u, stop, arrivals[u])) for u in urls]
    await asyncio.sleep(1.0)  # the stream reaches a steady state
    t0 = time.perf_counter()
    push = await sync.publish(version)
    t1 = time.perf_counter()
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*tasks)
    return {
        "publish_s": t1 - t0,
        "push_s": push["push_time_s"],
        "gap_s": max(longest_gap(a, t0 - 0.5, t1 + 0.5) for a in arrivals.values()),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--servers", default="1,2,4", help="server counts for the push-time table")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    model = str(ensure_tiny_checkpoint() if a.model == "tiny" else ensure_smollm2_checkpoint())
    counts = [int(x) for x in a.servers.split(",")]
    cluster = await rlactors.init()
    try:
        tcfg = TrainConfig(n_ranks=1, model_path=model, push=PushConfig(pause_mode="retract"))
        ranks = await cluster.spawn_group(TrainerRank, 1, tcfg, name="trainer", env={"OMP_NUM_THREADS": "1"})
        await cluster.collective_group(list(ranks), backend="gloo")
        await ranks.setup()
        server = ReferenceServerConfig(
            backend="hf", model_path=model, max_running_requests=16, cache_tokens=4096
        )
        pool = await cluster.spawn(
            InferencePool,
            PoolConfig(server=server, env={"OMP_NUM_THREADS": "1"}),
            name=POOL_NAME,
            control=True,
        )
        urls = await pool.start(max(counts))
        version = await ranks[0].version()  # a push sets the trainer's version (no training here)
        print(f"## push time vs servers ({a.model}, 1 trainer rank, reference servers, this machine)")
        print("| servers | push (median of reps) | publish |")
        print("| --- | --- | --- |")
        for n in counts:
            sync = PolicySync(cluster, ranks, urls[:n])
            await sync.connect()
            pushes, pubs = [], []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                pushes.append((await sync.publish(version))["push_time_s"])
                pubs.append(time.perf_counter() - t0)
            print(f"| {n} | {statistics.median(pushes):.3f} s | {statistics.median(pubs):.3f} s |")
            await sync.aclose()

        # the join: two servers serving; a third launched, then taken in at a publish
        for u in urls[2:]:
            await pool.remove(u, drain=False)
        sync = PolicySync(cluster, ranks, urls[:2], pool=pool)
        await sync.connect()
        await sync.publish(version)  # the removed ones are stopped after it
        normal = [await timed_publish(sync, version, urls[:2]) for _ in range(a.reps)]
        joins = []
        for _ in range(a.reps):
            (joiner,) = await pool.launch(1)  # starts while the others serve; not timed here
            joins.append(await timed_publish(sync, version, urls[:2]))
            assert joiner in sync.live, f"{joiner} did not join"
            await pool.remove(joiner, drain=False)
            await sync.publish(version)  # it leaves
        med = {k: statistics.median(r[k] for r in normal) for k in normal[0]}
        jmed = {k: statistics.median(r[k] for r in joins) for k in joins[0]}
        print(f"\n## the pause a join costs the serving servers ({a.model}, 2 serving, median of {a.reps})")
        print("| publish | publish time | push time | longest gap between answers on a serving server |")
        print("| --- | --- | --- | --- |")
        print(f"| normal | {med['publish_s']:.3f} s | {med['push_s']:.3f} s | {med['gap_s']:.3f} s |")
        print(
            f"| with a joiner | {jmed['publish_s']:.3f} s | {jmed['push_s']:.3f} s | {jmed['gap_s']:.3f} s |"
        )
        print(f"join gap / normal gap: {jmed['gap_s'] / med['gap_s']:.2f}x")
        await sync.aclose()
    finally:
        await cluster.close()


if __name__ == "__main__":
    asyncio.run(main())
