"""The trust model: workers hold a call credential that cannot start processes; a node's allow-list
refuses actor classes outside it. Over ipc (the embedded default) and TCP with CURVE or PLAIN."""

from __future__ import annotations

import pytest
import zmq
import zmq.asyncio

import rlactors
from protocols.runtime import wire
from rlactors.base.aio import wait_for
from rlactors.launch.config import agent_command, load_cluster_config
from rlactors.wire.security import Security, load_secret, module_allowed
from tests.runtime.actors import Counter

ADDRESSES = {
    "ipc": {"address": "ipc"},
    "tcp-curve": {"address": "tcp://127.0.0.1:0"},
    "tcp-plain": {"address": "tcp://127.0.0.1:0", "security": "plain"},
}


class Spawner(rlactors.Actor):
    """Tries, from inside a worker, what only the control credential should open."""

    async def spawn_counter(self, start: int, node_id: str | None = None) -> int:
        """Spawn a Counter (on ``node_id``) and call it; the PermissionError (if any) goes to the caller."""
        c = await rlactors.get_context().cluster.spawn(Counter, start, node_id=node_id)
        return await c.add(1)

    async def call(self, other: rlactors.ActorHandle, k: int) -> int:
        return await other.add(k)

    async def lookup(self, name: str) -> int:
        return await (await rlactors.get_context().cluster.get_actor(name)).value()


@pytest.mark.parametrize("where", list(ADDRESSES))
async def test_a_worker_calls_actors_but_cannot_spawn_unless_spawned_with_control(where: str) -> None:
    async with rlactors.init(**ADDRESSES[where]) as cluster:
        counter = await cluster.spawn(Counter, 10, name="counter")
        worker = await cluster.spawn(Spawner)
        assert await worker.call(counter, 5) == 15  # the data plane: calls and lookups
        assert await worker.lookup("counter") == 15
        with pytest.raises(PermissionError, match=r"head\.spawn needs the cluster's control credential"):
            await wait_for(worker.spawn_counter(0), 30)  # refused at once, not a hang
        assert [a["class_name"] for a in await cluster.actors()].count("Counter") == 1
        boss = await cluster.spawn(Spawner, control=True)
        assert await boss.spawn_counter(41) == 42
        assert await worker.call(counter, 1) == 16  # the cluster is healthy after the refusal


async def test_the_call_credential_cannot_start_a_worker_at_the_agent_or_join_as_a_node() -> None:
    async with rlactors.init(address="tcp://127.0.0.1:0") as cluster:
        full = Security(load_secret(cluster.secret_file))
        agent = next(n["address"] for n in await cluster.nodes())
        ctx = zmq.asyncio.Context()
        socks = []
        try:
            for address, target, method, args in (
                (agent, "agent", "start_worker", ["x", {"class": {"module": "os", "qualname": "X"}}]),
                (cluster.address, "head", "register_node", ["evil", agent, "127.0.0.1", {"cpu": 1}]),
                (agent, "agent", "shutdown", []),
            ):
                sock = ctx.socket(zmq.DEALER)
                socks.append(sock)
                full.calls.apply_client(sock)  # what a worker holds
                sock.connect(address)
                env = wire.encode_envelope(wire.Kind.CALL, 1, target, method, args, {}, 0)
                await sock.send_multipart(wire.join_batch([env]))
                reply = wire.decode_envelope(
                    wire.split_batch(await wait_for(sock.recv_multipart(copy=False), 10))[0]
                )
                assert reply[0] == wire.Kind.ERROR
                assert "PermissionError" in reply[2]["type"] and "control credential" in reply[2]["message"]
        finally:
            for sock in socks:
                sock.close(linger=0)
            ctx.term()
        assert [n["node_id"] for n in await cluster.nodes()] == ["local"]
        c = await cluster.spawn(Counter, 1)  # the agent still starts workers for the head
        assert await c.add(1) == 2


async def test_an_allow_list_refuses_other_modules_naming_the_class_and_the_list() -> None:
    async with rlactors.init(allowed_modules=["tests.runtime"]) as cluster:
        with pytest.raises(PermissionError) as refused:
            await cluster.spawn(Spawner)
        message = str(refused.value)
        assert "tests.cluster.test_trust:Spawner" in message and "['tests.runtime']" in message
        assert await cluster.actors() == []  # nothing left half-started
        c = await cluster.spawn(Counter, 1)  # tests.runtime.actors: allowed
        assert await c.add(1) == 2


def test_module_prefixes_match_whole_dotted_names() -> None:
    assert module_allowed("anything", None) and module_allowed("anything", [])
    for prefixes in (["nodes"], ["nodes."]):
        assert module_allowed("nodes", prefixes) and module_allowed("nodes.plane.buffer", prefixes)
        assert not module_allowed("nodes_evil", prefixes) and not module_allowed("os", prefixes)
    assert not module_allowed("__main__", ["nodes", "recipes"])


def test_cluster_toml_allowed_modules_reach_every_agent_command(tmp_path) -> None:
    toml = tmp_path / "cluster.toml"
    toml.write_text(
        '[head]\nhost = "127.0.0.1"\n[cluster]\nallowed_modules = ["nodes", "recipes"]\n'
        '[[nodes]]\nhost = "127.0.0.1"\n[[nodes]]\nhost = "127.0.0.1"\n'
    )
    cfg = load_cluster_config(toml)
    for node in cfg.nodes:
        cmd = agent_command(cfg, node, "secret", "logs")
        flags = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--allow-module"]
        assert flags == ["nodes", "recipes"]


class Intruder(rlactors.Actor):
    """Tries, from inside a worker, what only an owner with the control credential may do."""

    async def kill(self, name: str) -> bool:
        cluster = rlactors.get_context().cluster
        return await cluster.kill(await cluster.get_actor(name))

    async def reserve(self) -> str:
        return (await rlactors.get_context().cluster.reserve([{"cpu": 0.1}])).group_id

    async def release(self, group_id: str) -> None:
        # a handle to a group the driver made: removing it is the control plane's
        await rlactors.PlacementGroup(group_id, [], rlactors.get_context().cluster).release()

    async def kv_get(self, key: str) -> object:
        return await rlactors.get_context().cluster.kv_get(key)

    async def kv_put(self, key: str, value: object) -> None:
        await rlactors.get_context().cluster.kv_put(key, value)


@pytest.mark.parametrize("where", ["ipc", "tcp-curve"])
async def test_a_worker_cannot_kill_place_or_read_secrets_without_the_control_credential(where: str) -> None:
    async with rlactors.init(**ADDRESSES[where]) as cluster:
        victim = await cluster.spawn(Counter, 1, name="victim")
        worker = await cluster.spawn(Intruder)
        await cluster.kv_put("secret/inference/server-keys", ["k1", "k2"])
        await cluster.kv_put("rendezvous/open", 7)
        group = await cluster.reserve([{"cpu": 0.1}])
        refusals = {
            "killing an actor": worker.kill("victim"),
            "creating a placement group": worker.reserve(),
            "removing a placement group": worker.release(group.group_id),
            "reading a secret key": worker.kv_get("secret/inference/server-keys"),
            "writing a secret key": worker.kv_put("secret/inference/server-keys", ["evil", "evil"]),
        }
        for act, call in refusals.items():
            with pytest.raises(PermissionError) as refused:
                await wait_for(call, 30)
            assert f"{act} (head." in str(refused.value) and "control credential" in str(refused.value)
        # nothing was done: the victim answers, the group holds, the secret is the driver's
        assert await victim.add(1) == 2
        assert await cluster.kv_get("secret/inference/server-keys") == ["k1", "k2"]
        placed = await cluster.spawn(Counter, 5, placement=(group, 0))  # the group still holds
        assert await placed.add(1) == 6
        # the data plane stays open to the worker: a key that is not secret
        assert await worker.kv_get("rendezvous/open") == 7
        await worker.kv_put("rendezvous/open", 8)
        assert await cluster.kv_get("rendezvous/open") == 8
        # the open methods refuse a secret key however they are reached
        with pytest.raises(PermissionError, match="secret"):
            await cluster._client.head_call("kv_get", "secret/inference/server-keys", 0.0)
        await group.release()
