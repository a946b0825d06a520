"""Process death: pending and later calls fail with ActorDiedError (never hang); restarts."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

import rlactors
from protocols.runtime import codec, wire
from rlactors.base.aio import wait_for
from rlactors.head import head
from rlactors.wire import service
from rlactors.wire.runtime import RuntimeClient
from tests.runtime.actors import Counter, Watcher

# Generous bound that turns a hang into a failure; the 1 s target is measured in bench/rpc.py.
NO_HANG = 10


async def test_kill_9_fails_pending_and_later_calls(cluster) -> None:
    c = await cluster.spawn(Counter, name="victim")
    pid = await c.pid()
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()  # noqa: ASYNC240
    assert "rlactors.node.worker victim" in cmdline
    pending = [c.sleep(60) for _ in range(5)]
    os.kill(pid, signal.SIGKILL)
    for fut in pending:
        with pytest.raises(
            rlactors.ActorDiedError, match=r"actor victim \(\w+\) died: worker process killed by SIGKILL"
        ):
            await wait_for(fut, NO_HANG)
    with pytest.raises(rlactors.ActorDiedError):
        await wait_for(c.add(1), NO_HANG)
    streams = c.count_to(3)
    with pytest.raises(rlactors.ActorDiedError):
        await wait_for(streams.__anext__(), NO_HANG)


async def test_death_is_seen_by_other_actors_holding_the_handle(cluster) -> None:
    victim = await cluster.spawn(Counter)
    caller = await cluster.spawn(Counter)
    # The caller actor gets a handle and calls through it from its own process.
    assert await (await caller.echo(victim)).add(1) == 1
    os.kill(await victim.pid(), signal.SIGKILL)
    await wait_for(cluster.watch(victim), NO_HANG)
    with pytest.raises(rlactors.ActorDiedError):
        await wait_for(victim.add(1), NO_HANG)


async def test_max_restarts_reruns_the_constructor(cluster) -> None:
    c = await cluster.spawn(Counter, 10, max_restarts=1, name="phoenix")
    assert await c.add(5) == 15
    pid = await c.pid()
    pending = c.sleep(60)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(rlactors.ActorDiedError):
        await wait_for(pending, NO_HANG)  # at-most-once: the in-flight call is lost
    # Later calls wait for the restarted actor; state is fresh (constructor re-run).
    assert await wait_for(c.value(), 60) == 10
    assert await c.pid() != pid
    assert (await cluster.get_actor("phoenix")) == c
    info = next(a for a in await cluster.actors() if a["actor_id"] == c.actor_id)
    assert info["restarts"] == 1
    # Restarts exhausted: the next death is final.
    os.kill(await c.pid(), signal.SIGKILL)
    await wait_for(cluster.watch(c), NO_HANG)
    with pytest.raises(rlactors.ActorDiedError):
        await wait_for(c.value(), NO_HANG)


async def test_watch_returns_on_death(cluster) -> None:
    c = await cluster.spawn(Counter)
    watcher = asyncio.ensure_future(cluster.watch(c))
    await asyncio.sleep(0)
    assert not watcher.done()
    await cluster.kill(c)
    info = await wait_for(watcher, NO_HANG)
    assert info["state"] == "DEAD" and not info["restarting"]


async def test_an_actor_watching_another_hears_of_its_death_once(cluster) -> None:
    w = await cluster.spawn(Watcher)
    a, b = await cluster.spawn(Counter), await cluster.spawn(Counter)
    assert await w.watch(a.actor_id, "a") == 1
    assert await w.watch(a.actor_id, "a") == 1  # the same watch again: still one
    assert await w.watch(b.actor_id, "b") == 2
    os.kill(await a.pid(), signal.SIGKILL)
    assert await wait_for(w.wait_deaths(1), NO_HANG) == ["a"]
    await cluster.kill(b)
    assert await wait_for(w.wait_deaths(2), NO_HANG) == ["a", "b"]
    assert await w.watch(b.actor_id, "b") == 1  # a finished watch is forgotten; this one ends at once
    assert await wait_for(w.wait_deaths(3), NO_HANG) == ["a", "b", "b"]


async def test_malformed_frames_are_dropped_and_the_worker_keeps_serving(cluster) -> None:
    c = await cluster.spawn(Counter, 1)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    cluster._local.head.security.calls.apply_client(sock)  # over ipc too, a peer presents a credential
    sock.connect(c.address)
    try:
        garbage = [
            [b"not msgpack at all \xff\xfe"],
            [b"\x91\x05", b"too few frames"],
            wire.join_batch([codec.encode([99, 1, 1, None, "add", [1], {}, 0])]),  # wrong version
            wire.join_batch([codec.encode([wire.PROTOCOL_VERSION, 1, 2, None, "add"])]),  # truncated
            wire.join_batch([codec.encode([wire.PROTOCOL_VERSION, 77, 3])]),  # unknown kind
        ]
        for frames in garbage:
            sock.send_multipart(frames)
        # A well-formed call on the same raw socket still gets its answer.
        sock.send_multipart(
            wire.join_batch([wire.encode_envelope(wire.Kind.CALL, 9, None, "add", [1], {}, 0)])
        )
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        replies = []
        deadline = asyncio.get_running_loop().time() + NO_HANG
        while asyncio.get_running_loop().time() < deadline:
            if poller.poll(50):
                for env in wire.split_batch(sock.recv_multipart()):
                    replies.append(wire.decode_envelope(env))
                if any(r[1] == 9 for r in replies):
                    break
            await asyncio.sleep(0)
        assert [wire.Kind.RESULT, 9, 2] in replies
        # The truncated call could not be decoded, but its id could: it got an error back, not silence.
        assert any(r[0] == wire.Kind.ERROR and r[1] == 2 for r in replies)
    finally:
        sock.close()
    assert await c.add(1) == 3


class LogRecorder:
    """Stands in for a module's structlog logger: keeps warnings, ignores the rest."""

    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, object]]] = []
        self.changed = asyncio.Event()

    def warning(self, event: str, **fields: object) -> None:
        self.warnings.append((event, fields))
        self.changed.set()

    def __getattr__(self, level: str) -> object:
        return lambda *args, **kwargs: None

    async def wait_for(self, predicate, timeout: float = NO_HANG) -> None:
        async with asyncio.timeout(timeout):
            while not any(predicate(event, fields) for event, fields in self.warnings):
                self.changed.clear()
                await self.changed.wait()


async def test_a_flood_of_garbage_is_logged_in_a_few_lines_that_count_it(monkeypatch) -> None:
    recorder = LogRecorder()
    monkeypatch.setattr(service, "log", recorder)
    monkeypatch.setattr(service, "LOG_EVERY_S", 0.5, raising=False)
    async with rlactors.init() as cluster:
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        cluster._local.head.security.calls.apply_client(sock)
        sock.connect(cluster.address)
        try:
            for _ in range(2000):
                await sock.send_multipart([b"garbage \xff"])
            # Messages from one peer are handled in order: the answer to a ping comes after the flood.
            await sock.send_multipart(wire.join_batch([wire.encode_envelope(wire.Kind.PING, 1)]))
            await wait_for(sock.recv_multipart(), NO_HANG)
            assert len(recorder.warnings) < 50  # one line per message before: 2,000
            # The end of the flood is reported with its count.
            await recorder.wait_for(lambda event, fields: fields.get("total") == 2000)
        finally:
            sock.close()


async def test_calls_to_a_stopped_worker_fail_as_unreachable_and_recover(cluster) -> None:
    c = await cluster.spawn(Counter)
    pid = await c.pid()
    os.kill(pid, signal.SIGSTOP)  # alive to its agent and the head, but it answers nothing
    try:
        pending = c.sleep(60)
        with pytest.raises(rlactors.ActorUnreachableError, match="lost the connection"):
            await wait_for(pending, 30)
        with pytest.raises(rlactors.ActorUnreachableError):  # while it stays silent, at once
            await wait_for(c.add(1), 1)
    finally:
        os.kill(pid, signal.SIGCONT)
    async with asyncio.timeout(30):  # the connection comes back; calls go through again
        while True:
            try:
                assert await c.add(1) == 1
                break
            except rlactors.ActorUnreachableError:
                await asyncio.sleep(0.2)


async def test_the_head_keeps_a_bounded_number_of_dead_actors(monkeypatch) -> None:
    monkeypatch.setattr(head, "MAX_DEAD_ACTORS", 2)
    async with rlactors.init() as cluster:
        victims = [await cluster.spawn(Counter) for _ in range(4)]
        for v in victims:
            await cluster.kill(v)
        listed = {a["actor_id"] for a in await cluster.actors()}
        assert listed == {victims[2].actor_id, victims[3].actor_id}  # the two latest deaths
        # A client that never heard of the first one still gets an error, not a hang.
        stranger = RuntimeClient(cluster.address, cluster._local.head.security, name="stranger")
        await stranger.start()
        try:
            call = stranger.call_actor(victims[0].actor_id, victims[0].address, "add", (1,), {})
            with pytest.raises(rlactors.ActorDiedError, match="unknown to the head"):
                await wait_for(call, NO_HANG)
        finally:
            await stranger.close()


async def test_session_folders_of_killed_processes_are_removed_by_the_next_session() -> None:
    import tempfile

    from rlactors.launch.local import _pid_namespace

    dead = await asyncio.create_subprocess_exec("true")  # a pid whose process has exited
    await dead.wait()
    folders = {}
    for owner, pid in (("dead", dead.pid), ("alive", os.getpid())):
        folders[owner] = Path(tempfile.mkdtemp(prefix=f"rlx-test-{owner}-", dir="/tmp"))
        (folders[owner] / "owner").write_text(f"{pid} {_pid_namespace()}")
    try:
        async with rlactors.init() as cluster:
            assert await cluster.nodes()
        assert not folders["dead"].exists() and folders["alive"].exists()
    finally:
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)
