"""A rollout actor restarted by the runtime (max_restarts) while training goes on: no group lost or
trained twice, the new incarnation starts at the current version, skips what the buffer accepted,
and its driver's calls survive the restart."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

import rlactors
from nodes.plane.buffer import BufferActor
from nodes.plane.governor import GovernorActor, GovernorConfig
from nodes.rollout.actor import Rollout, RolloutActor, RolloutHandle
from nodes.rollout.client import SGLangClient
from nodes.rollout.config import RolloutConfig
from nodes.rollout.workflows import RLVRConfig, WorkflowSpec
from rlactors.base.aio import wait_for
from tests.helpers.cluster import worker_pid
from tests.helpers.servers import wait_until

B, ETA, N = 2, 1, 16
WORKFLOW = WorkflowSpec(config=RLVRConfig(n_samples=2, max_new_tokens=64))
PROMPTS = {"kind": "arithmetic", "n": N}
CONFIG = RolloutConfig(max_inflight=4, acquire_batch=2, acquire_timeout_s=1.0)


async def spawn_rollout(cluster, url: str, **kw) -> RolloutHandle:
    handle = await cluster.spawn(
        RolloutActor, [url], "gov", "buf", PROMPTS, WORKFLOW, CONFIG, name="r", max_restarts=1, **kw
    )
    return RolloutHandle(handle, 1)


async def test_a_restarted_rollout_actor_loses_and_repeats_no_group(cluster, sim_server: str) -> None:
    gov = await cluster.spawn(GovernorActor, GovernorConfig(B, ETA, 8), name="gov")
    buf = await cluster.spawn(BufferActor, "gov", name="buf")
    r = await spawn_rollout(cluster, sim_server)
    seen: list[str] = []
    version = 0

    async def train_step() -> None:  # as the recipe: a batch at the version, then publish the next one
        nonlocal version
        batch = await buf.get_batch(B, version, 60)
        assert batch.max_staleness <= ETA
        seen.extend(g.group_id for g in batch.groups)
        version += 1
        await gov.set_version(version)
        await r.set_version(version, [sim_server])

    async def admitted(in_flight: bool) -> bool:  # the bound reached, the episodes done or in flight
        g, b = await gov.stats(), await buf.stats()
        return g["capacity"] == 0 and g["running"] == b["in_flight"] and (b["in_flight"] > 0) == in_flight

    async with httpx.AsyncClient(base_url=sim_server, timeout=30) as admin:
        await train_step()
        await wait_until(lambda: admitted(False), timeout_s=30, what="episodes of version 1 done")
        await admin.post("/pause_generation", json={"mode": "in_place"})  # hold what is admitted next
        try:
            await train_step()  # opens capacity: episodes are admitted and held mid-flight
            await wait_until(lambda: admitted(True), timeout_s=30, what="episodes held in flight on r")
            accepted_before = (await buf.stats())["accepted"]
            os.kill(await worker_pid(cluster, r.handle), signal.SIGKILL)
        finally:
            await admin.post("/continue_generation", json={})

    while len(seen) < N:  # the driver's calls wait for the restarted incarnation
        await train_step()
    assert sorted(seen) == sorted(f"arithmetic/e0/{i}" for i in range(N))  # nothing lost, nothing twice
    g, b, s = await gov.stats(), await buf.stats(), await r.stats()
    assert s["restarts"] == 1 and g["holder_deaths"] == 1
    assert b["requeued"] > 0 and b["requeue_pending"] == 0  # the dead incarnation's episodes re-ran
    assert b["dropped_stale"] == 0 and b["ready"] == 0 and g["running"] == 0
    # The replayed shard skipped the groups accepted before the restart instead of asking the buffer
    # for each (a re-run re-queued episode may still be refused once when the shard reaches it).
    assert accepted_before >= 4 and s["refused_begin"] <= b["requeued"]


async def test_a_restarted_rollout_actor_starts_at_the_governors_version(cluster) -> None:
    gov = await cluster.spawn(GovernorActor, GovernorConfig(B, ETA, 8), name="gov")
    await cluster.spawn(BufferActor, "gov", name="buf")
    r = await spawn_rollout(cluster, "http://127.0.0.1:9", autostart=False)  # admits nothing
    await gov.set_version(3)
    os.kill(await worker_pid(cluster, r.handle), signal.SIGKILL)
    s = await r.stats()  # interrupted by the death, or made while it restarts: reaches the new one
    assert s["restarts"] == 1 and s["version"] == 3  # spawned at version 0
    # the new incarnation's process: its one restart is spent, so calls fail as before
    os.kill(await worker_pid(cluster, r.handle), signal.SIGKILL)
    with pytest.raises(rlactors.ActorDiedError, match="SIGKILL"):
        await wait_for(r.stats(), 30)


class DyingHandle:
    """A stand-in actor handle whose first ``deaths`` calls die with the actor."""

    def __init__(self, deaths: int) -> None:
        self.deaths, self.calls = deaths, 0

    async def stats(self) -> dict[str, int]:
        self.calls += 1
        if self.calls <= self.deaths:
            raise rlactors.ActorDiedError(f"actor r died (call {self.calls})", "r")
        return {"calls": self.calls}


async def test_a_call_interrupted_by_a_restart_is_made_again_until_the_restarts_are_spent() -> None:
    assert await RolloutHandle(DyingHandle(2), max_restarts=2).stats() == {"calls": 3}
    with pytest.raises(rlactors.ActorDiedError, match="call 2"):
        await RolloutHandle(DyingHandle(2), max_restarts=1).stats()  # dead for good: today's error
    with pytest.raises(AttributeError):
        RolloutHandle(DyingHandle(0), 1)._private  # noqa: B018


def test_set_version_with_servers_stops_routing_to_the_others() -> None:
    a, b = "http://a:1", "http://b:1/"
    r = Rollout("h", SGLangClient([a, b]), None, iter(()), None, None)  # type: ignore[arg-type]
    r.set_version(4, [b])
    assert r.client.urls == ["http://b:1"] and r.client.version == 4
    r.set_version(5)  # without servers: routing unchanged
    assert r.client.urls == ["http://b:1"] and r.client.version == 5
