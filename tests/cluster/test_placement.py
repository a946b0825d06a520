"""Placement: resources, strategies, bundles (all or nothing), GPU visibility, collective groups."""

from __future__ import annotations

import asyncio

import pytest

import rlactors
from rlactors.head.placement import NodeResources, choose_node, plan_bundles
from tests.cluster.actors import Member


def test_choose_node_pack_and_spread() -> None:
    nodes = {"a": NodeResources({"cpu": 4}), "b": NodeResources({"cpu": 4})}
    nodes["a"].acquire({"cpu": 1})
    assert choose_node(nodes, {"cpu": 1}, strategy="pack") == "a"
    assert choose_node(nodes, {"cpu": 1}, strategy="spread") == "b"
    with pytest.raises(rlactors.PlacementError, match=r"no node can fit \{'cpu': 5\}.*a: \{cpu=3\}"):
        choose_node(nodes, {"cpu": 5})


def test_bundles_are_all_or_nothing() -> None:
    nodes = {"a": NodeResources({"cpu": 2, "gpu": 2}), "b": NodeResources({"cpu": 2, "gpu": 1})}
    assert sorted(plan_bundles(nodes, [{"gpu": 1}] * 3, "spread")) == ["a", "a", "b"]
    assert plan_bundles(nodes, [{"gpu": 1}, {"gpu": 1}], "strict_spread") in (["a", "b"], ["b", "a"])
    with pytest.raises(rlactors.PlacementError, match="does not fit"):
        plan_bundles(nodes, [{"gpu": 1}] * 4, "pack")
    # Planning never takes anything from the real nodes.
    assert nodes["a"].used == {} and nodes["a"].free_gpus == [0, 1]


async def test_gpus_become_cuda_visible_devices_and_release_on_death() -> None:
    async with rlactors.init(resources={"gpu": 2}) as cluster:
        keys = ["CUDA_VISIBLE_DEVICES"]
        a = await cluster.spawn(Member, resources={"gpu": 1})
        b = await cluster.spawn(Member, resources={"gpu": 1})
        seen = {(await a.env(keys))["CUDA_VISIBLE_DEVICES"], (await b.env(keys))["CUDA_VISIBLE_DEVICES"]}
        assert seen == {"0", "1"}
        none = await cluster.spawn(Member)
        assert (await none.env(keys))["CUDA_VISIBLE_DEVICES"] == ""  # no GPU asked, none visible
        with pytest.raises(rlactors.PlacementError, match="gpu"):
            await cluster.spawn(Member, resources={"gpu": 1})
        a_device = (await a.env(keys))["CUDA_VISIBLE_DEVICES"]
        await cluster.kill(a)
        c = await cluster.spawn(Member, resources={"gpu": 1})  # a's GPU came back
        assert (await c.env(keys))["CUDA_VISIBLE_DEVICES"] == a_device


async def test_reserved_bundles_hold_resources_for_their_actors() -> None:
    async with rlactors.init(resources={"cpu": 2, "gpu": 2}) as cluster:
        pg = await cluster.reserve([{"gpu": 1}, {"gpu": 1}])
        # The reservation holds both GPUs: nothing else can take them.
        with pytest.raises(rlactors.PlacementError):
            await cluster.spawn(Member, resources={"gpu": 1})
        with pytest.raises(rlactors.PlacementError, match="does not fit"):
            await cluster.reserve([{"gpu": 1}])
        members = [await cluster.spawn(Member, placement=(pg, i)) for i in range(2)]
        devices = {(await m.env(["CUDA_VISIBLE_DEVICES"]))["CUDA_VISIBLE_DEVICES"] for m in members}
        assert devices == {"0", "1"}
        with pytest.raises(rlactors.PlacementError, match="in use"):
            await cluster.spawn(Member, placement=(pg, 0))
        await pg.release()
        with pytest.raises(rlactors.ActorDiedError):
            await members[0].env([])
        assert await cluster.spawn(Member, resources={"gpu": 2})


async def test_collective_group_over_gloo(cluster) -> None:
    members = [await cluster.spawn(Member, name=f"m{i}") for i in range(3)]
    group = await cluster.collective_group(members, backend="gloo", timeout=60)
    assert group.world_size == 3
    envs = [await m.env(["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"]) for m in members]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"} and [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert envs[0]["MASTER_PORT"] == str(group.master_port)
    results = await asyncio.gather(*(m.broadcast([1.5, 2.5]) for m in members))
    assert results == [[1.5, 2.5]] * 3
    assert await asyncio.gather(*(m.all_reduce(float(i)) for i, m in enumerate(members))) == [3.0] * 3


async def test_collective_group_names_the_member_that_did_not_join(cluster) -> None:
    members = [await cluster.spawn(Member, name=f"g{i}") for i in range(2)]
    blocker = members[1].busy.submit(30)  # its sync thread is busy: it cannot join
    with pytest.raises(rlactors.ClusterError, match=r"rank 1 \(g1 on node local\) did not join within 3s"):
        await cluster.collective_group(members, backend="gloo", timeout=3)
    await cluster.kill(members[1])
    blocker.cancel()


async def test_rendezvous_reserves_a_port_and_publishes_it(cluster) -> None:
    info = await cluster.rendezvous("weights", 3)
    assert info["world_size"] == 3 and info["master_port"] > 0 and info["master_address"] == "127.0.0.1"
    assert await cluster.kv_get("rendezvous/weights") == info
    other = await cluster.rendezvous("weights-2", 2)
    assert other["master_port"] != info["master_port"]


async def test_gpu_indices_map_through_the_agents_own_visible_devices(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    async with rlactors.init() as cluster:  # detects 2 GPUs: physical 6 and 7
        a = await cluster.spawn(Member, resources={"gpu": 1})
        b = await cluster.spawn(Member, resources={"gpu": 1})
        seen = {(await m.env(["CUDA_VISIBLE_DEVICES"]))["CUDA_VISIBLE_DEVICES"] for m in (a, b)}
    assert seen == {"6", "7"}
