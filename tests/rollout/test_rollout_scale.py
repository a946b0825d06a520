"""The rollout plane through actors at the concurrency it is configured for (issue 14).

With the buffer an actor, admission once began one episode per round trip, so requests in flight
stayed at a few dozen whatever the concurrency; these tests count them where they land, at the
server, with rollout actors, governor and buffer each in a process of its own.
"""

from __future__ import annotations

import httpx

from nodes.plane.buffer import BufferActor
from nodes.plane.governor import GovernorActor, GovernorConfig
from nodes.rollout.actor import RolloutActor
from nodes.rollout.config import RolloutConfig
from nodes.rollout.workflows import RLVRConfig, WorkflowSpec
from rlactors.base.aio import wait_for
from tests.helpers.servers import wait_load
from tests.rollout.actors import SlowBeginBuffer

K = 2
WORKFLOW = WorkflowSpec(config=RLVRConfig(n_samples=K, max_new_tokens=8))


async def test_requests_in_flight_reach_the_configured_concurrency(cluster, sim_server: str) -> None:
    """Two rollout actors sharding the prompts, 96 episodes at once between them: with generation
    paused in place, every one of their 96 * K requests reaches the server and waits there."""
    C, actors = 96, 2
    gov = await cluster.spawn(GovernorActor, GovernorConfig(batch_size=C, max_staleness=1, max_concurrent=C))
    buf = await cluster.spawn(BufferActor, gov)
    async with httpx.AsyncClient(base_url=sim_server, timeout=30) as admin:
        await admin.post("/pause_generation", json={"mode": "in_place"})
        try:
            rollouts = []
            for i in range(actors):
                rollouts.append(
                    await cluster.spawn(
                        RolloutActor,
                        [sim_server],
                        gov,
                        buf,
                        {"kind": "arithmetic", "n": 4 * C, "epochs": None},
                        WORKFLOW,
                        RolloutConfig(max_inflight=C // actors, acquire_batch=16),
                        shard=i,
                        num_shards=actors,
                    )
                )
            await wait_load(admin, running=0, waiting=C * K)
            assert (await gov.stats())["running"] == C
            assert (await buf.stats())["in_flight"] == C
        finally:
            await admin.post("/continue_generation", json={})
    # and the plane drains into batches once generation continues
    batch = await buf.get_batch(C, 0, timeout=60)
    assert len(batch.groups) == C and all(len(g.trajectories) == K for g in batch.groups)
    shards = {int(g.group_id.rsplit("/", 1)[1]) % actors for g in batch.groups}
    assert shards == set(range(actors))  # both actors' shards made it
    for r in rollouts:
        await wait_for(r.stop(), 30)


async def test_a_grants_begins_overlap_through_the_actors(cluster, sim_server: str) -> None:
    """A buffer actor that takes 20 ms per begin: the rollout actor begins a grant's 96 episodes at
    once (one at a time, episodes in flight would be capped near episode time / 20 ms)."""
    C = 96
    gov = await cluster.spawn(GovernorActor, GovernorConfig(batch_size=C, max_staleness=1, max_concurrent=C))
    buf = await cluster.spawn(SlowBeginBuffer, gov)
    rollout = await cluster.spawn(
        RolloutActor,
        [sim_server],
        gov,
        buf,
        {"kind": "arithmetic", "n": 4 * C, "epochs": None},
        WORKFLOW,
        RolloutConfig(max_inflight=C, acquire_batch=C),
    )
    batch = await buf.get_batch(C, 0, timeout=60)
    assert len(batch.groups) == C
    assert await buf.peak_begins() == C  # the first grant (all C) was begun at once
    await wait_for(rollout.stop(), 30)
