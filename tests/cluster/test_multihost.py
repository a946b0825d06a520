"""Several hosts on one machine (network namespaces): placement, cross-host calls and gloo,
partition of a host, kill -9 of a node agent, and an agent that comes back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import rlactors
from rlactors.base.aio import wait_for
from rlactors.wire.security import new_secret_file
from tests.cluster.actors import Member
from tests.cluster.netns import Hosts, hosts_fixture, skip_module_without_netns

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[2]
NODE_TIMEOUT = 2.0
NO_HANG = 15

skip_module_without_netns()


hosts = hosts_fixture(2)


class Cluster2:
    def __init__(self, hosts: Hosts, tmp: Path) -> None:
        self.hosts = hosts
        self.secret = str(new_secret_file(tmp / "secret"))
        self.address = f"tcp://{hosts.gateway}:{_free_port(hosts.gateway)}"
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start_head(self) -> None:
        self.procs["head"] = self._popen(
            [
                sys.executable,
                "-m",
                "rlactors.launch.daemons",
                "head",
                "--bind",
                self.address,
                "--secret-file",
                self.secret,
                "--node-timeout",
                str(NODE_TIMEOUT),
            ],
            "head",
        )

    def start_agent(self, i: int) -> None:
        cmd = [
            *self.hosts.exec_prefix(i),
            sys.executable,
            "-m",
            "rlactors.launch.daemons",
            "agent",
            "--head",
            self.address,
            "--node-id",
            f"h{i}",
            "--host",
            self.hosts.ip(i),
            "--secret-file",
            self.secret,
            "--resources",
            '{"cpu": 2, "slot": 1}',
        ]  # no GLOO_SOCKET_IFNAME: the worker finds eth0 from --host
        self.procs[f"h{i}"] = self._popen(cmd, f"agent-h{i}")

    def _popen(self, cmd: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            start_new_session=True,
        )

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _wait_nodes(cluster: rlactors.Cluster, alive: set[str], timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while {n["node_id"] for n in await cluster.nodes() if n["alive"]} != alive:  # noqa: ASYNC110 (remote state)
            await asyncio.sleep(0.1)


@pytest.fixture
async def two_hosts(hosts: Hosts, tmp_path: Path) -> AsyncIterator[tuple[rlactors.Cluster, Cluster2]]:
    c2 = Cluster2(hosts, tmp_path)
    try:
        c2.start_head()
        c2.start_agent(0)
        c2.start_agent(1)
        cluster = await rlactors.connect(c2.address, secret_file=c2.secret, timeout=30)
        await _wait_nodes(cluster, {"h0", "h1"})
        yield cluster, c2
        await cluster.close()
    finally:
        c2.stop()


async def test_actors_on_two_hosts_call_each_other_and_form_a_gloo_group(two_hosts) -> None:
    cluster, c2 = two_hosts
    a = await cluster.spawn(Member, name="a", node_id="h0")
    b = await cluster.spawn(Member, name="b", node_id="h1")
    assert a.address.startswith(f"tcp://{c2.hosts.ip(0)}:") and b.address.startswith(
        f"tcp://{c2.hosts.ip(1)}:"
    )
    assert await a.node() == "h0" and await b.node() == "h1"
    # Custom resources are per host: one "slot" each.
    with pytest.raises(rlactors.PlacementError):
        await cluster.spawn(Member, resources={"slot": 2})
    group = await cluster.collective_group([a, b], backend="gloo", timeout=60)
    assert group.master_address == c2.hosts.ip(0)
    assert await asyncio.gather(a.broadcast([3.0, 4.0]), b.broadcast([0.0, 0.0])) == [[3.0, 4.0]] * 2


async def test_partition_is_detected_and_the_host_rejoins(two_hosts) -> None:
    cluster, c2 = two_hosts
    b = await cluster.spawn(Member, node_id="h1")
    pending = b.busy.submit(60)
    c2.hosts.partition(1)
    try:
        with pytest.raises(rlactors.ActorDiedError, match="stopped answering"):
            await wait_for(pending, NO_HANG)
        await _wait_nodes(cluster, {"h0"})
        with pytest.raises(rlactors.ActorDiedError):
            await wait_for(b.node(), NO_HANG)
    finally:
        c2.hosts.heal(1)
    # The agent comes back: it is told it was declared dead, drops its workers, registers again.
    await _wait_nodes(cluster, {"h0", "h1"})
    again = await cluster.spawn(Member, node_id="h1")
    assert await again.node() == "h1"


async def test_a_one_way_partition_between_caller_and_worker_fails_the_call(two_hosts) -> None:
    cluster, c2 = two_hosts
    caller = await cluster.spawn(Member, node_id="h0")
    worker = await cluster.spawn(Member, node_id="h1")
    assert await caller.call_other(worker, "node") == "'h1'"
    # h1 can no longer send to h0; both still talk to the head, which sees every node alive.
    c2.hosts.blackhole(1, c2.hosts.ip(0))
    try:
        outcome = await wait_for(caller.call_other(worker, "busy", 60), 40)
        assert outcome.startswith("ActorUnreachableError"), outcome
        assert {n["node_id"] for n in await cluster.nodes() if n["alive"]} == {"h0", "h1"}
    finally:
        c2.hosts.unblackhole(1, c2.hosts.ip(0))
    # Healed: the caller reconnects and calls go through again.
    async with asyncio.timeout(30):
        while await caller.call_other(worker, "node") != "'h1'":  # noqa: ASYNC110 (remote state)
            await asyncio.sleep(0.2)


async def test_a_worker_cut_off_from_one_caller_is_not_replaced(two_hosts) -> None:
    cluster, c2 = two_hosts
    caller = await cluster.spawn(Member, node_id="h0")
    worker = await cluster.spawn(Member, node_id="h1", max_restarts=1)
    pid = await worker.pid()
    c2.hosts.blackhole(1, c2.hosts.ip(0))
    try:  # the caller's first connection to it cannot come up: its call fails, never waits forever
        outcome = await wait_for(caller.call_other(worker, "busy", 60), 40)
        assert outcome.startswith("ActorUnreachableError: could not connect"), outcome
    finally:
        c2.hosts.unblackhole(1, c2.hosts.ip(0))
    # The caller gave up about 9 s after the cut, past fence_after (node_timeout + 6 s): had the
    # worker's own agent lost it too, it would have been killed by now. Its agent still hears it.
    (info,) = [a for a in await cluster.actors() if a["actor_id"] == worker.actor_id]
    assert info["state"] == "ALIVE" and info["restarts"] == 0 and info["pid"] == pid
    assert await wait_for(worker.pid(), NO_HANG) == pid


async def test_a_partitioned_nodes_actor_is_not_run_twice(two_hosts) -> None:
    cluster, c2 = two_hosts
    m = await cluster.spawn(Member, name="once", node_id="h1", max_restarts=2)
    pid = await m.pid()
    c2.hosts.partition(1)
    try:
        death = await wait_for(cluster.watch(m), 30)
        # Dead, not restarted (here or on h0): its old incarnation may still run, cut off.
        assert death["state"] == "DEAD" and not death["restarting"], death
        await _wait_nodes(cluster, {"h0"})
        assert _running(pid)  # it does still run
        with pytest.raises(rlactors.ActorNotFoundError):
            await cluster.get_actor("once")
    finally:
        c2.hosts.heal(1)
    # Back, its agent is told it was declared dead and stops the stale worker before registering.
    await _wait_nodes(cluster, {"h0", "h1"})
    async with asyncio.timeout(NO_HANG):
        while _running(pid):  # noqa: ASYNC110 (another process's state)
            await asyncio.sleep(0.1)


def _running(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


# A driver on host h0 with an actor on h1: it prints the actor's id, then (told on stdin) calls it.
DRIVER = """
import asyncio, sys
import rlactors
from rlactors.base.aio import wait_for
from tests.cluster.actors import Member

async def main():
    cluster = await rlactors.connect()
    m = await cluster.spawn(Member, node_id="h1")
    print(m.actor_id, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    try:
        print("answered", await wait_for(m.node(), 30), flush=True)
    except Exception as e:  # the test reads whatever the call raised
        print(type(e).__name__, e, flush=True)

asyncio.run(main())
"""


async def test_a_driver_cut_off_past_client_timeout_learns_its_actor_died(two_hosts) -> None:
    cluster, c2 = two_hosts
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RLACTORS_ADDRESS": c2.address,
        "RLACTORS_SECRET_FILE": c2.secret,
    }
    proc = await asyncio.create_subprocess_exec(
        *c2.hosts.exec_prefix(0),
        sys.executable,
        "-c",
        DRIVER,
        cwd=ROOT,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        actor_id = (await wait_for(proc.stdout.readline(), 60)).decode().strip()
        c2.hosts.partition(0)
        try:  # the head gives the silent driver up and stops its actor
            assert (await wait_for(cluster.watch(actor_id), 60))["state"] == "DEAD"
        finally:
            c2.hosts.heal(0)
        proc.stdin.write(b"go\n")
        line = (await wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith("ActorDiedError") and "was silent" in line, line
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_kill_9_of_a_node_agent_is_detected(two_hosts) -> None:
    cluster, c2 = two_hosts
    a = await cluster.spawn(Member, node_id="h0")
    pending = a.busy.submit(60)
    os.kill(c2.procs["h0"].pid, signal.SIGKILL)
    with pytest.raises(rlactors.ActorDiedError):
        await wait_for(pending, NO_HANG)
    await _wait_nodes(cluster, {"h1"})
    b = await cluster.spawn(Member)  # placement skips the dead host
    assert await b.node() == "h1"
