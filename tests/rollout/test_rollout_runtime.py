"""The rollout plane on the runtime: governor, buffer and rollout actors; kill -9 mid-episode."""

from __future__ import annotations

import os
import signal

import httpx

from nodes.plane.buffer import BufferActor
from nodes.plane.governor import GovernorActor, GovernorConfig
from nodes.rollout.actor import RolloutActor
from nodes.rollout.config import RolloutConfig
from nodes.rollout.workflows import RLVRConfig, WorkflowSpec
from rlactors.base.aio import wait_for
from tests.helpers.cluster import worker_pid
from tests.helpers.servers import wait_until

B, ETA, N = 2, 1, 16
WORKFLOW = WorkflowSpec(config=RLVRConfig(n_samples=2, max_new_tokens=64))
PROMPTS = {"kind": "arithmetic", "n": N}


async def spawn_rollout(cluster, url: str, name: str):
    return await cluster.spawn(
        RolloutActor,
        [url],
        "gov",
        "buf",
        PROMPTS,
        WORKFLOW,
        RolloutConfig(max_inflight=4, acquire_batch=2, acquire_timeout_s=1.0),
        name=name,
    )


async def test_kill_9_of_a_rollout_actor_mid_episode(cluster, sim_server: str) -> None:
    gov = await cluster.spawn(GovernorActor, GovernorConfig(B, ETA, 8), name="gov")
    buf = await cluster.spawn(BufferActor, "gov", name="buf")
    assert (await buf.stats())["max_staleness"] == ETA  # no bound given: the governor's
    async with httpx.AsyncClient(base_url=sim_server, timeout=30) as admin:
        # Hold generation so the victim's episodes are certainly mid-flight when it dies.
        await admin.post("/pause_generation", json={"mode": "in_place"})
        try:
            victim = await spawn_rollout(cluster, sim_server, "r0")

            async def episodes_in_flight() -> bool:
                return (await buf.stats())["in_flight"] == 4  # the governor's capacity at version 0

            await wait_until(episodes_in_flight, timeout_s=30, what="episodes in flight on r0")
            os.kill(await worker_pid(cluster, victim), signal.SIGKILL)
            await wait_for(cluster.watch(victim), 10)
        finally:
            await admin.post("/continue_generation", json={})

    # The death notices release the leases and take the episodes off the books.
    async def settled() -> bool:
        g, b = await gov.stats(), await buf.stats()
        return (
            g["running"] == 0 and b["in_flight"] == 0 and g["accepted"] == b["accepted"] - b["dropped_stale"]
        )

    await wait_until(settled, timeout_s=10, what="governor and buffer to settle after the death")
    b = await buf.stats()
    assert b["requeued"] == 4 and b["requeue_pending"] == 4 and b["ready"] == 0 and b["accepted"] == 0

    # A replacement replays the same source: re-queued episodes re-run, accepted ones are skipped.
    await spawn_rollout(cluster, sim_server, "r1")
    seen: list[str] = []
    for v in range(N // B):
        batch = await buf.get_batch(B, v, 60)
        batch.validate()
        assert batch.max_staleness <= ETA and all(len(g.trajectories) == 2 for g in batch.groups)
        seen += [g.group_id for g in batch.groups]
        await gov.set_version(v + 1)
    assert sorted(seen) == sorted(f"arithmetic/e0/{i}" for i in range(N))  # nothing lost, nothing twice
    g, b = await gov.stats(), await buf.stats()
    assert g["running"] == 0 and g["accepted"] == N and b["ready"] == 0 and b["in_flight"] == 0
    assert g["holder_deaths"] == 1 and b["requeue_pending"] == 0


async def test_the_rollout_configs_client_section_reaches_the_actors_client(cluster) -> None:
    """[rollout.client] travels inside RolloutConfig: a server that refuses connections is retried as
    many times as the actor's config says, not as the default."""
    from nodes.rollout.config import ClientConfig

    gov = await cluster.spawn(GovernorActor, GovernorConfig(B, ETA, 2), name="gov")
    await cluster.spawn(BufferActor, "gov", name="buf")
    fast = ClientConfig(max_retries=1, backoff_base_s=0.001, backoff_max_s=0.001, down_cooldown_s=0.01)
    dead = "http://127.0.0.1:9"  # discard port: refused at once
    r = await cluster.spawn(
        RolloutActor,
        [dead],
        "gov",
        "buf",
        PROMPTS,
        WORKFLOW,
        RolloutConfig(max_inflight=1, acquire_batch=1, acquire_timeout_s=1.0, client=fast),
        name="r",
    )

    async def failed_once() -> bool:
        return (await r.stats())["episodes_failed"] >= 1

    await wait_until(failed_once, timeout_s=30, what="an episode to fail on the dead server")
    s = await r.stats()
    # at most one retry per request, as configured (the default, 3, gave 10 for 4 requests)
    assert 0 < s["client_retries"] <= s["client_requests"]
    await r.stop()

    async def released() -> bool:  # the buffer tells the governor (one-way), so this lands a moment later
        return (await gov.stats())["running"] == 0

    await wait_until(released, timeout_s=10, what="the stopped actor's leases to be released")
