"""Nothing dropped silently: a reply to a caller that has gone is logged at warning, naming the actor
and the method; the backlog of messages to a peer that does not read is bounded, and holds back
whoever sends to it until the peer reads again, when everything arrives.

The peers here are raw ZeroMQ DEALER sockets (a caller that vanishes, or reads nothing until told
to), talking to a real :class:`Service` or ROUTER over ipc.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

import rlactors
from protocols.runtime import wire
from protocols.runtime.wire import Kind
from rlactors.base.aio import wait_for
from rlactors.wire import transport
from rlactors.wire.service import Service
from tests.runtime.actors import Counter

MiB = 1 << 20
N = 24  # replies of 1 MiB each, to a bound of 2 MiB
BOUND = 2 * MiB


@pytest.fixture(autouse=True)
def small_queues(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeroMQ's queue to a peer holds 2 messages, so the backlog fills after a few; a raw peer
    that does not ping would be cut as silent after 6 s (on a loaded machine the test may take
    longer)."""
    monkeypatch.setattr(transport, "SNDHWM", 2)
    monkeypatch.setattr(transport, "HEARTBEAT_TIMEOUT_MS", 120_000)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def _dealer(ctx: zmq.asyncio.Context, address: str, ident: bytes) -> zmq.asyncio.Socket:
    """A caller that reads only when told: it takes one message in, the rest wait at the sender."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, ident)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _call(call_id: int, method: str, *args: Any) -> list[Any]:
    return wire.join_batch([wire.encode_envelope(Kind.CALL, call_id, None, method, list(args), {}, 0)])


async def _until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Let the loop run until ``cond()`` holds (the state here changes in this loop's callbacks)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def _unroutable(router: zmq.Socket, ident: bytes) -> bool:
    """Whether ``router`` (ROUTER_MANDATORY) refuses a message to ``ident`` as unreachable; a probe
    that goes out reaches a peer that has closed, which reads nothing."""
    try:
        router.send_multipart([ident, b""], zmq.NOBLOCK)
    except zmq.ZMQError as e:
        return e.errno == zmq.EHOSTUNREACH
    return False


async def _call_one_by_one(dealer: zmq.asyncio.Socket, blobs: Blobs, method: str, n: int) -> None:
    """Make ``n`` calls, each after the last has returned, so each reply leaves as a message of its
    own (the replies of one loop turn to one caller go out together)."""
    for i in range(n):
        before = blobs.returned
        await dealer.send_multipart(_call(i + 1, method, i))
        await _until(lambda before=before: blobs.returned > before, f"call {i + 1} to return")
        await asyncio.sleep(0)


async def _replies(sock: zmq.asyncio.Socket, n: int) -> dict[int, Any]:
    """Read until ``n`` RESULT envelopes have come: call id -> value."""
    out: dict[int, Any] = {}
    while len(out) < n:
        frames = await wait_for(sock.recv_multipart(copy=False), 30)
        for env in wire.split_batch(frames):
            msg = wire.decode_envelope(env)
            assert msg[0] == Kind.RESULT, msg
            assert msg[1] not in out, f"reply {msg[1]} came twice"
            out[msg[1]] = msg[2]
    return out


class Blobs:
    """Returns 1 MiB per call, from the loop or from the sync thread."""

    def __init__(self) -> None:
        self.returned = 0
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.release_sync = threading.Event()

    async def blob(self, i: int) -> bytes:
        self.returned += 1
        return bytes([i % 256]) * MiB

    def blob_sync(self, i: int) -> bytes:
        self.returned += 1
        return bytes([i % 256]) * MiB

    async def late(self) -> str:
        self.started.set()
        await self.release.wait()
        return "too late"

    def late_sync(self) -> str:
        self.started_sync = True
        self.release_sync.wait(30)
        return "too late"

    async def blobs(self, n: int) -> AsyncIterator[bytes]:
        for i in range(n):
            self.returned += 1
            yield bytes([i % 256]) * MiB
            await asyncio.sleep(0)  # each item leaves as a message of its own


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[tuple[Service, Blobs]]:
    svc = Service(name="blobs-actor")
    blobs = Blobs()
    svc.add(None, blobs)
    svc.bind(f"ipc://{tmp_path}/svc")
    assert svc._asock is not None
    svc._asock.backlog_bytes = BOUND
    yield svc, blobs
    blobs.release.set()
    blobs.release_sync.set()
    await svc.close()


@pytest.mark.parametrize("method", ["blob", "blob_sync"])
async def test_replies_to_a_caller_that_does_not_read_wait_and_all_arrive(
    service: tuple[Service, Blobs], zctx: zmq.asyncio.Context, method: str
) -> None:
    svc, blobs = service
    asock = svc._asock
    assert asock is not None
    ident = b"slow-reader"
    dealer = _dealer(zctx, svc.address, ident)
    await _call_one_by_one(dealer, blobs, method, N)
    # Each call has returned, but the replies past the bound are held (their calls still running,
    # waiting for room), not queued: the backlog stays within its bound plus one message.
    for _ in range(50):
        await asyncio.sleep(0)
    held = len(svc._running)
    assert held > 0
    messages, nbytes = asock.backlog(ident)
    assert nbytes <= BOUND + MiB + 4096
    assert messages <= BOUND // MiB + 1
    # The reader reads: everything comes, once each, and nothing is held any more.
    got = await _replies(dealer, N)
    assert sorted(got) == list(range(1, N + 1))
    for call_id, value in got.items():
        assert bytes(value) == bytes([(call_id - 1) % 256]) * MiB
    await _until(lambda: not svc._running, "the held calls to finish")
    assert asock.backlog(ident) == (0, 0)
    dealer.close()


async def test_one_stalled_caller_does_not_hold_up_another(
    service: tuple[Service, Blobs], zctx: zmq.asyncio.Context
) -> None:
    svc, blobs = service
    asock = svc._asock
    assert asock is not None
    stalled = _dealer(zctx, svc.address, b"stalled")
    await _call_one_by_one(stalled, blobs, "blob", N)
    held = len(svc._running)
    assert held > 0
    other = _dealer(zctx, svc.address, b"other")
    for i in range(4):
        await other.send_multipart(_call(i + 1, "blob", 100 + i))
    got = await _replies(other, 4)
    assert sorted(got) == [1, 2, 3, 4]
    assert len(svc._running) == held  # still held: nobody read them
    assert len(await _replies(stalled, N)) == N
    stalled.close()
    other.close()


async def test_a_stream_to_a_consumer_that_does_not_read_waits_and_all_arrive(
    service: tuple[Service, Blobs], zctx: zmq.asyncio.Context
) -> None:
    svc, blobs = service
    asock = svc._asock
    assert asock is not None
    ident = b"slow-consumer"
    dealer = _dealer(zctx, svc.address, ident)
    env = wire.encode_envelope(Kind.CALL, 1, None, "blobs", [N], {}, wire.Flags.STREAM)
    await dealer.send_multipart(wire.join_batch([env]))
    # The generator is held before its next item once the consumer's backlog is full.
    await _until(
        lambda: ident in asock._backlogs and bool(asock._backlogs[ident].waiters), "the stream to wait"
    )
    for _ in range(50):
        await asyncio.sleep(0)
    produced = blobs.returned
    assert produced < N
    assert asock.backlog(ident)[1] <= BOUND + MiB + 4096
    items: list[bytes] = []
    ended = False
    while not ended:
        frames = await wait_for(dealer.recv_multipart(copy=False), 30)
        for e in wire.split_batch(frames):
            msg = wire.decode_envelope(e)
            assert msg[1] == 1
            if msg[0] == Kind.STREAM_END:
                ended = True
            else:
                assert msg[0] == Kind.STREAM_ITEM, msg
                items.append(bytes(msg[2]))
    assert items == [bytes([i % 256]) * MiB for i in range(N)]  # all of them, in order
    dealer.close()


@pytest.mark.parametrize("method", ["late", "late_sync"])
async def test_a_reply_to_a_caller_that_vanished_is_logged_with_actor_and_method(
    service: tuple[Service, Blobs], zctx: zmq.asyncio.Context, method: str
) -> None:
    svc, blobs = service
    asock = svc._asock
    assert asock is not None
    gone = asyncio.Event()
    transport.monitor(asock, zmq.EVENT_DISCONNECTED, lambda event, endpoint: gone.set())
    dealer = _dealer(zctx, svc.address, b"vanishing")
    await dealer.send_multipart(_call(7, method))
    await _until(lambda: blobs.started.is_set() or getattr(blobs, "started_sync", False), "the call to start")
    dealer.close(linger=0)  # the caller's process exits before its reply is sent
    await wait_for(gone.wait(), 30)
    # The monitor hears of the disconnect from ZeroMQ's I/O thread; the ROUTER drops the route
    # when its own thread next handles commands. A reply sent in between is discarded with the
    # connection, unseen (transport.py says so): the feature is about a caller ZeroMQ knows is gone.
    await _until(lambda: _unroutable(asock.sock, b"vanishing"), "ZeroMQ to drop the route to the caller")
    with capture_logs() as logs:
        blobs.release.set()
        blobs.release_sync.set()
        await _until(lambda: not svc._running, "the call to finish")
        await _until(lambda: any(e["event"].startswith("reply not delivered") for e in logs), "the log line")
    [entry] = [e for e in logs if e["event"].startswith("reply not delivered")]
    assert entry["log_level"] == "warning"
    assert entry["actor"] == "blobs-actor"
    assert entry["method"] == method
    assert entry["replies"] == 1


async def test_a_sender_awaiting_room_is_held_until_the_peer_reads(
    tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    hello = asyncio.Event()
    router, address = transport.bind_router(
        f"ipc://{tmp_path}/router", lambda frames: hello.set(), None, name="router"
    )
    router.backlog_bytes = BOUND
    ident = b"reader"
    dealer = _dealer(zctx, address, ident)
    await dealer.send(b"hello")  # the router routes to a peer once it has heard from it
    await wait_for(hello.wait(), 30)
    sent = 0

    async def sender() -> None:
        nonlocal sent
        for i in range(N):
            await router.room(ident)
            router.send([ident, i.to_bytes(4, "big") + bytes(MiB - 4)])
            sent += 1

    task = asyncio.get_running_loop().create_task(sender())
    # Held once the backlog filled; it resumes when the backlog is down to half the bound.
    await _until(
        lambda: ident in router._backlogs and bool(router._backlogs[ident].waiters), "the sender to wait"
    )
    for _ in range(50):
        await asyncio.sleep(0)
    assert not task.done()  # held back: the peer reads nothing
    assert sent < N
    assert router.backlog(ident)[1] <= BOUND + MiB
    received = []
    while len(received) < N:
        [frame] = await wait_for(dealer.recv_multipart(), 30)
        received.append(int.from_bytes(frame[:4], "big"))
    assert received == list(range(N))  # all of them, in order
    await wait_for(task, 30)
    assert router.backlog(ident) == (0, 0)
    dealer.close()
    router.close()


async def test_messages_to_a_peer_that_vanished_with_a_backlog_are_reported(
    tmp_path: Path, zctx: zmq.asyncio.Context
) -> None:
    hello = asyncio.Event()
    router, address = transport.bind_router(
        f"ipc://{tmp_path}/router", lambda frames: hello.set(), None, name="router"
    )
    lost: list[tuple[bytes | None, list[Any]]] = []
    router.on_undeliverable = lambda peer, labels: lost.append((peer, labels))
    gone = asyncio.Event()
    transport.monitor(router, zmq.EVENT_DISCONNECTED, lambda event, endpoint: gone.set())
    dealer = _dealer(zctx, address, b"reader")
    await dealer.send(b"hello")
    await wait_for(hello.wait(), 30)
    for i in range(12):
        router.send([b"reader", bytes(MiB)], [f"m{i}"])
    assert router.backlog(b"reader")[0] > 0
    dealer.close(linger=0)
    await wait_for(gone.wait(), 30)
    await _until(lambda: router.backlog(b"reader") == (0, 0), "the backlog to be given up")
    [(peer, labels)] = lost
    assert peer == b"reader"
    assert labels == [f"m{i}" for i in range(12 - len(labels), 12)]  # the ones ZeroMQ had not taken
    router.close()


async def test_the_bound_comes_from_cluster_toml_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlactors.launch.config import agent_command, load_cluster_config

    path = tmp_path / "cluster.toml"
    path.write_text(
        '[head]\nhost = "10.0.0.1"\n[cluster]\nsend_backlog_bytes = 1048576\n[[nodes]]\nhost = "a"\n'
    )
    cfg = load_cluster_config(path)
    assert "--send-backlog-bytes 1048576" in " ".join(agent_command(cfg, cfg.nodes[0], "/s", "/l"))
    # The agent and head call set_send_backlog with it: this process and the workers it starts.
    monkeypatch.setenv(transport.SEND_BACKLOG_BYTES_ENV, str(transport.send_backlog_bytes()))
    transport.set_send_backlog(3 * MiB)
    try:
        router, _ = transport.bind_router(f"ipc://{tmp_path}/r", lambda frames: None, None, name="r")
        assert router.backlog_bytes == 3 * MiB
        assert transport._backlog_from_env() == 3 * MiB  # what a worker started now reads
        router.close()
    finally:
        transport.set_send_backlog(transport.DEFAULT_SEND_BACKLOG_BYTES)


async def test_a_driver_telling_an_actor_that_does_not_read_is_held_back_by_drain(
    cluster: rlactors.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calling side: tells never block, and ``rlactors.drain`` holds a sender back once its
    backlog to a stopped actor is at the bound; after SIGCONT everything arrives, in order."""
    monkeypatch.setattr(transport, "_send_backlog_bytes", BOUND)  # read when the connection opens
    sink = await cluster.spawn(Counter)
    pid = await sink.pid()
    os.kill(pid, signal.SIGSTOP)
    sent, held = 0, False
    try:
        while sent < 4 * N:
            sink.take.tell(sent, bytes(MiB))
            sent += 1
            try:
                await wait_for(rlactors.drain(sink), 1.0)
            except TimeoutError:
                held = True
                break
    finally:
        os.kill(pid, signal.SIGCONT)
    # held after ZeroMQ's queue (2 messages here) and the 2 MiB bound filled, not after 4 N
    assert held and sent <= 8, sent
    await wait_for(rlactors.drain(sink), 30)
    assert await sink.get_log() == list(range(sent))  # all of them, once, in order
    await wait_for(rlactors.drain(sink), 1)  # nothing waits now: at once
