"""The Rollout core end to end in one process: governor + buffer + client + sim server + a trainer loop."""

from __future__ import annotations

import asyncio
import time

import httpx

from nodes.plane.buffer import BufferConfig, TrajectoryBuffer
from nodes.plane.governor import GovernorConfig, StalenessGovernor
from nodes.rollout.actor import Rollout
from nodes.rollout.client import SGLangClient
from nodes.rollout.config import RolloutConfig
from nodes.rollout.prompts import prompt_source
from nodes.rollout.workflows import RLVRConfig, WorkflowSpec, build_workflow
from rlactors.base.aio import wait_for

WORKFLOW = WorkflowSpec(config=RLVRConfig(n_samples=2, max_new_tokens=24))


def make(url: str, n_prompts: int, B: int, eta: int, **cfg):
    gov = StalenessGovernor(GovernorConfig(B, eta, max_concurrent=64))
    buf = TrajectoryBuffer(BufferConfig(max_staleness=eta), governor=gov)
    client = SGLangClient([url])
    rollout = Rollout(
        "h0",
        client,
        build_workflow(WORKFLOW),
        prompt_source({"kind": "arithmetic", "n": n_prompts}),
        gov,
        buf,
        RolloutConfig(**cfg),
    )
    return gov, buf, client, rollout


async def train(
    buf: TrajectoryBuffer,
    gov: StalenessGovernor,
    rollout: Rollout,
    steps: int,
    B: int,
    eta: int,
    on_step=None,
) -> list[str]:
    seen: list[str] = []
    for v in range(steps):
        batch = await buf.get_batch(B, v, timeout=60)
        batch.validate()
        assert batch.max_staleness <= eta
        seen += [g.group_id for g in batch.groups]
        if on_step is not None:
            await on_step(v)
        gov.set_version(v + 1)
        rollout.set_version(v + 1)
    return seen


async def test_every_prompt_trained_on_exactly_once(sim_server: str) -> None:
    B, eta, n = 3, 1, 12
    gov, buf, client, rollout = make(sim_server, n, B, eta, max_inflight=8, acquire_batch=4)
    run = asyncio.create_task(rollout.run())
    seen = await train(buf, gov, rollout, n // B, B, eta)
    await wait_for(run, 30)
    await client.aclose()
    assert sorted(seen) == sorted(f"arithmetic/e0/{i}" for i in range(n))
    s = rollout.stats()
    assert s["episodes_done"] == n and s["trajectories"] == 2 * n and s["client_requests"] == 2 * n
    assert gov.running == 0 and gov.accepted == n and buf.in_flight == 0 and buf.ready == 0
    assert s["acquires"] < s["granted"] + 10  # grants come in batches, not one call per episode


async def test_pause_for_weight_updates_mid_run(sim_server: str) -> None:
    B, eta, n = 2, 1, 8
    gov, buf, client, rollout = make(sim_server, n, B, eta, max_inflight=8)
    run = asyncio.create_task(rollout.run())

    async with httpx.AsyncClient(base_url=sim_server, timeout=30) as admin:
        waiting_at_continue: list[tuple[int, int]] = []  # (re-posted, waiting at the server)

        async def weight_update(v: int) -> None:
            rollout.pause()
            await admin.post("/pause_generation", json={"mode": "abort"})
            await admin.post("/update_weight_version", json={"new_version": str(v + 1)})
            rollout.set_version(v + 1)
            await rollout.resume()  # the held requests re-post; the paused server holds them
            reposted = rollout.client.reposts[-1][3]
            deadline = time.monotonic() + 10
            while True:  # the re-posts are on their way (a loaded machine delays them)
                waiting = (await admin.get("/v1/loads")).json()["loads"][0]["num_waiting_reqs"]
                if waiting >= reposted or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)  # the server's load is polled; it announces nothing
            waiting_at_continue.append((reposted, waiting))
            await admin.post("/continue_generation", json={})

        seen = await train(buf, gov, rollout, n // B, B, eta, on_step=weight_update)
        # the server continued with work waiting whenever the pause had held requests
        assert any(r for r, _ in waiting_at_continue), waiting_at_continue
        assert all(w >= 1 for r, w in waiting_at_continue if r), waiting_at_continue
    await wait_for(run, 30)
    await client.aclose()
    assert sorted(seen) == sorted(f"arithmetic/e0/{i}" for i in range(n))
    assert gov.running == 0 and buf.in_flight == 0


async def test_a_failing_episode_releases_its_lease(sim_server: str) -> None:
    gov, buf, client, rollout = make(sim_server, 4, 2, 1)

    class Broken:
        async def arun_episode(self, client, item, group_id=None):
            raise RuntimeError("reward server down")

    rollout.workflow = Broken()
    await wait_for(rollout.run(), 30)
    await client.aclose()
    assert rollout.stats()["episodes_failed"] == 4
    assert gov.running == 0 and gov.accepted == 0 and buf.in_flight == 0 and buf.stats()["abandoned"] == 4


async def test_resume_trains_every_prompt_once_per_epoch(sim_server: str) -> None:
    """Stop after 3 of 6 steps with more groups admitted than trained, resume from what was trained:
    across both runs every prompt of epoch 0 is trained exactly once, then epoch 1 begins."""
    from nodes.rollout.prompts import trained_position

    B, eta, n = 2, 2, 12
    spec = {"kind": "arithmetic", "n": n, "epochs": None, "shuffle": True, "seed": 3}
    gov, buf, client, rollout = make(sim_server, n, B, eta, max_inflight=8)
    rollout.prompts = prompt_source(spec)
    run = asyncio.create_task(rollout.run())
    first = await train(buf, gov, rollout, 3, B, eta)
    for _ in range(500):  # the last batch may have been ready before the rollout admitted more
        if buf.ready + buf.in_flight > 0:
            break
        await asyncio.sleep(0.01)
    assert buf.ready + buf.in_flight > 0  # admitted but not trained when the "checkpoint" is taken
    await rollout.stop()
    await wait_for(run, 30)
    await client.aclose()
    pos = trained_position(first, n)
    assert pos == {"done_epochs": 0, "trained": sorted(first)}

    gov = StalenessGovernor(GovernorConfig(B, eta, max_concurrent=64))
    gov.recover(3)
    buf = TrajectoryBuffer(BufferConfig(max_staleness=eta), governor=gov, done_ids=pos["trained"])
    client = SGLangClient([sim_server])
    source = prompt_source({**spec, "start_epoch": pos["done_epochs"]})
    rollout = Rollout("h1", client, build_workflow(WORKFLOW), source, gov, buf, RolloutConfig(max_inflight=8))
    rollout.set_version(3)
    run = asyncio.create_task(rollout.run())
    second: list[str] = []
    v = 3
    while not all(f"arithmetic/e0/{i}" in first + second for i in range(n)):  # groups of epoch 1 may
        batch = await buf.get_batch(B, v, timeout=60)  # come first within one admission version
        assert batch.max_staleness <= eta
        second += [g.group_id for g in batch.groups]
        v += 1
        gov.set_version(v)
        rollout.set_version(v)
        assert v < 12, "epoch 0 never completed"
    await rollout.stop()
    await wait_for(run, 30)
    await client.aclose()
    epoch0 = [g for g in first + second if "/e0/" in g]
    assert sorted(epoch0) == sorted(f"arithmetic/e0/{i}" for i in range(n))  # each once, none skipped
    epoch1 = [g for g in second if "/e1/" in g]
    assert len(set(epoch1)) == len(epoch1)
    assert trained_position(first + second, n) == {"done_epochs": 1, "trained": sorted(epoch1)}


async def test_cancelling_run_stops_it_and_its_episodes(sim_server: str) -> None:
    """A cancel from outside (asyncio.run's teardown, an embedding service) ends run() and every
    episode, and their leases go back, even when it lands as the governor wakes the loop."""
    B, eta = 2, 1
    gov, buf, client, rollout = make(sim_server, 40, B, eta, max_inflight=8)
    run = asyncio.create_task(rollout.run())
    await buf.get_batch(B, 0, timeout=60)
    gov.set_version(1)  # wakes the loop's acquire ...
    rollout.set_version(1)
    run.cancel()  # ... in the same turn as the cancel
    done, _ = await asyncio.wait({run}, timeout=10)
    assert run in done and run.cancelled()
    assert rollout.inflight == 0 and rollout.stopping
    await client.aclose()
    assert gov.running == 0 and buf.in_flight == 0  # abandoned episodes returned their leases


def test_shuffled_epochs_are_reproducible_and_shards_partition_them() -> None:
    spec = {"kind": "arithmetic", "n": 10, "epochs": 2, "shuffle": True, "seed": 1}
    ids = [g for g, _ in prompt_source(spec)]
    assert ids == [g for g, _ in prompt_source(spec)]
    e0, e1 = ids[:10], ids[10:]
    assert sorted(e0) == sorted(f"arithmetic/e0/{i}" for i in range(10)) and e0 != sorted(
        e0, key=lambda g: int(g.rsplit("/", 1)[1])
    )
    assert [g.split("/")[-1] for g in e0] != [g.split("/")[-1] for g in e1]  # a new order each epoch
    shards = [[g for g, _ in prompt_source(spec, s, 3)] for s in range(3)]
    assert sorted(g for shard in shards for g in shard) == sorted(ids)
    assert [g for g, _ in prompt_source({**spec, "start_epoch": 1})] == e1


async def test_a_rerun_episode_does_not_meet_its_earlier_runs_requests(sim_server: str) -> None:
    """A re-queued (or resumed) episode starts again while its earlier run's requests may still be on
    the server (their actor died, or their abort is on its way): SGLang refuses a duplicate request
    id, so each run of an episode has its own."""
    wf = build_workflow(WORKFLOW)
    client = SGLangClient([sim_server])
    async with httpx.AsyncClient(base_url=sim_server, timeout=30) as admin:
        await admin.post("/pause_generation", json={"mode": "in_place"})  # the first run stays on the server
        try:
            first = asyncio.create_task(wf.arun_episode(client, {"question": "1+1"}, "arithmetic/e0/7"))
            for _ in range(500):
                if (await admin.get("/v1/loads")).json()["loads"][0]["num_running_reqs"] >= 2:
                    break
                await asyncio.sleep(0.01)
            second = asyncio.create_task(wf.arun_episode(client, {"question": "1+1"}, "arithmetic/e0/7"))
            await asyncio.sleep(0.2)
        finally:
            await admin.post("/continue_generation", json={})
        groups = await wait_for(asyncio.gather(first, second), 30)
    await client.aclose()
    assert [g.group_id for g in groups] == ["arithmetic/e0/7"] * 2
    assert client.counters["errors"] == 0


async def test_dynamic_sampling_keeps_batches_full_and_sees_every_prompt_once(sim_server: str) -> None:
    """With ``drop_no_signal``, every third prompt's group has equal rewards: it is dropped, the
    governor admits the next prompt in its place, batches stay full, and across trained and dropped
    each prompt of the epoch is seen exactly once (the dropped ones complete the epoch too)."""
    from nodes.rollout.prompts import trained_position

    B, eta, n = 2, 1, 12
    gov, buf, client, rollout = make(sim_server, n, B, eta, max_inflight=8)
    buf.config = BufferConfig(max_staleness=eta, drop_no_signal=True)
    inner = rollout.workflow

    class EveryThirdFlat:
        async def arun_episode(self, client, item, group_id=None):
            group = await inner.arun_episode(client, item, group_id)
            flat = int(group_id.rsplit("/", 1)[1]) % 3 == 0
            for k, t in enumerate(group.trajectories):
                t.reward = 0.0 if flat else float(k)
            return group

    rollout.workflow = EveryThirdFlat()
    run = asyncio.create_task(rollout.run())
    trained = await train(buf, gov, rollout, (n - n // 3) // B, B, eta)  # asserts each batch is full
    await wait_for(run, 30)
    await client.aclose()
    dropped = buf.take_dropped()
    assert sorted(dropped) == sorted(f"arithmetic/e0/{i}" for i in range(0, n, 3))
    assert sorted(trained + dropped) == sorted(f"arithmetic/e0/{i}" for i in range(n))
    assert buf.stats()["dropped_no_signal"] == n // 3 and buf.stats()["accepted"] == len(trained)
    assert gov.running == 0 and gov.accepted == len(trained) and buf.in_flight == 0 and buf.ready == 0
    assert trained_position(trained + dropped, n) == {"done_epochs": 1, "trained": []}
