"""No process dies inside ZeroMQ: liveness is our own pings, not ZMTP heartbeats.

libzmq 4.3.5 aborts (``Assertion failed: !_io_error (src/stream_engine_base.cpp:310)``,
zeromq/libzmq#4364) when its ZMTP heartbeat timer fires on a connection that was closing while
its peer sent and then hung up. The churn here (tests/runtime/zmq_churn.py) makes that state by
the thousand; with the transport's settings no process aborts, and with ZMTP heartbeats turned on
the same churn aborts (the control: the test reaches the bug). The liveness that replaced the
heartbeats keeps their behaviour: a silent peer's connection is cut on both sides, and a peer
whose event loop is blocked still answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from rlactors.base.aio import wait_for
from rlactors.wire import peers, transport
from rlactors.wire.client import Connection
from rlactors.wire.service import Service

ROOT = Path(__file__).resolve().parents[2]
CHURN = ROOT / "tests/runtime/zmq_churn.py"
ABORT = "Assertion failed: !_io_error"


def _churn(*args: str, timeout: float) -> tuple[int, str, str]:
    """Run the churn in its own session (its peers with it); kill them all if it overruns."""
    proc = subprocess.Popen(
        [sys.executable, str(CHURN), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the churn did not finish in {timeout:g}s:\n{out[-2000:]}\n{err[-4000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # peers left behind by an abort
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def test_thousands_of_connections_to_peers_that_vanish_mid_send_abort_no_process() -> None:
    rc, out, err = _churn("--dealer-rounds", "1000", "--router-peers", "1000", timeout=240)
    assert ABORT not in err, err[-4000:]
    assert rc == 0, f"exit {rc}:\n{out[-2000:]}\n{err[-4000:]}"
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["died"] == []
    assert summary["dealer_rounds"] >= 1000 and summary["router_peers"] >= 1000, summary
    assert summary["peer_kills"] >= 25, summary  # peers SIGKILLed mid-send, not only closed


def test_with_zmtp_heartbeats_on_the_same_churn_aborts() -> None:
    """The control: the churn reaches libzmq's assertion when heartbeats are on (every 1 ms, so
    that it comes within the test's time). Should a libzmq release fix #4364, this fails; the
    transport's pings are then a choice, no longer a necessity."""
    rc, out, err = _churn(
        "--zmtp-heartbeat-ms", "1", "--dealer-rounds", "3000", "--router-peers", "0", timeout=240
    )
    assert ABORT in err, f"no abort (exit {rc}) with ZMTP heartbeats on:\n{out[-2000:]}\n{err[-2000:]}"


async def test_no_socket_of_ours_asks_for_zmtp_heartbeats(tmp_path: Path) -> None:
    """ZMQ_HEARTBEAT_IVL 0 on both ends: none of ours sends a ZMTP PING, whose answer can abort too."""
    router, address = transport.bind_router(f"ipc://{tmp_path}/r", lambda frames: None, None, name="r")
    dealer = transport.connect_dealer(address, lambda frames: None, None, name="d")
    try:
        for asock in (router, dealer):
            assert asock.sock.getsockopt(zmq.HEARTBEAT_IVL) == 0
    finally:
        dealer.close()
        router.close()


@pytest.fixture
def quick_timeout(monkeypatch: pytest.MonkeyPatch) -> Iterator[float]:
    """A 1.5 s silence timeout, pinging every 0.3 s: the same rules, sooner."""
    monkeypatch.setattr(transport, "HEARTBEAT_IVL_MS", 300)
    monkeypatch.setattr(transport, "HEARTBEAT_TIMEOUT_MS", 1500)
    monkeypatch.setattr(transport, "STALL_S", 0.45)
    yield 1.5


async def test_a_router_cuts_a_peer_that_stays_silent(tmp_path: Path, quick_timeout: float) -> None:
    """A DEALER that says one thing and then nothing (a stopped caller) is disconnected, as ZMTP
    heartbeats did, so that replies to it stop piling up; a peer that pings is kept."""
    heard: list[bytes] = []
    router, address = transport.bind_router(
        f"ipc://{tmp_path}/r", lambda frames: heard.append(frames[0].bytes), None, name="r"
    )
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.DEALER)
    silent.setsockopt(zmq.LINGER, 0)
    events = silent.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    kept = Connection(address, None, name="pinging")
    try:
        silent.connect(address)
        silent.send_multipart([b"hello"])
        await wait_for(kept.wait_link(), 10)
        deadline = time.monotonic() + 30
        while not events.poll(0):  # the monitor's socket is not on this loop
            assert time.monotonic() < deadline, "the silent peer was never disconnected"
            await asyncio.sleep(0.05)
        assert parse_monitor_message(events.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED
        assert heard == [heard[0]]  # it was heard once, then cut
        assert kept.linked  # the connection that pings was not
    finally:
        kept.close()
        events.close(linger=0)
        silent.close(linger=0)
        router.close()


async def test_a_dealer_whose_peer_is_stopped_loses_its_link_and_reconnects_when_it_wakes(
    tmp_path: Path, quick_timeout: float
) -> None:
    """A peer process stopped with SIGSTOP (its ZeroMQ I/O thread too) is silent: the DEALER's
    link goes down (on_link(False): callers fail after LINK_GRACE_S), and comes back once the
    peer wakes."""
    address = f"ipc://{tmp_path}/stopped"
    peer = await asyncio.create_subprocess_exec(
        sys.executable, "-c", STOPPED_PEER, address, stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    links: list[bool] = []
    changed = asyncio.Event()

    def on_link(up: bool) -> None:
        links.append(up)
        changed.set()

    async def until(pattern: list[bool]) -> None:
        while links[-len(pattern) :] != pattern:
            changed.clear()
            await wait_for(changed.wait(), 30)

    dealer = None
    try:
        assert peer.stdout is not None and (await wait_for(peer.stdout.readline(), 30)).strip() == b"ready"
        dealer = transport.connect_dealer(address, lambda frames: None, None, name="d", on_link=on_link)
        await until([True])
        peer.send_signal(signal.SIGSTOP)
        await until([True, False])  # cut as silent
        peer.send_signal(signal.SIGCONT)
        await until([True, False, True])  # reconnected
    finally:
        if dealer is not None:
            dealer.close()
        peer.kill()
        await peer.wait()


# A ROUTER that reads (its I/O thread) but never says anything: stopped, it reads nothing either.
STOPPED_PEER = """
import sys, time, zmq
r = zmq.Context().socket(zmq.ROUTER)
r.bind(sys.argv[1])
print("ready", flush=True)
time.sleep(600)
"""


def _serve_on_a_thread(address: str) -> tuple[asyncio.AbstractEventLoop, Service, threading.Thread]:
    """A Service with one method, on an event loop of its own thread (a worker's, in miniature)."""

    class Echo:
        async def echo(self, x: Any) -> Any:
            return x

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Service] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def start() -> None:
            svc = Service(name="blocked")
            svc.add(None, Echo())
            svc.bind(address)
            holder["svc"] = svc
            ready.set()

        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30)
    return loop, holder["svc"], thread


@pytest.fixture
async def blocked_service(tmp_path: Path) -> AsyncIterator[tuple[asyncio.AbstractEventLoop, str]]:
    address = f"ipc://{tmp_path}/svc"
    loop, svc, thread = _serve_on_a_thread(address)
    yield loop, svc.address
    asyncio.run_coroutine_threadsafe(svc.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()


async def test_a_service_whose_loop_is_blocked_still_answers_pings(
    blocked_service: tuple[asyncio.AbstractEventLoop, str], quick_timeout: float
) -> None:
    """The ping thread answers for a blocked loop (ZMTP's I/O thread did): its callers keep their
    link through a block of several timeouts, and a call made meanwhile is answered after it."""
    loop, address = blocked_service
    links: list[bool] = []
    conn = Connection(address, None, name="caller", on_link=links.append)
    try:
        assert await wait_for(conn.call("echo", (1,), {}), 30) == 1
        block_s = 4 * quick_timeout
        loop.call_soon_threadsafe(time.sleep, block_s)  # the scenario: the service's loop blocks
        await asyncio.sleep(0.5)
        pending = conn.call("echo", (2,), {})
        await asyncio.sleep(block_s)  # the scenario itself: time passes while the loop is blocked
        assert await wait_for(pending, 30) == 2
        assert links == [True], links  # never cut
    finally:
        conn.close()


async def _relay(target_port: int, rate: int) -> tuple[asyncio.Server, int]:
    """A TCP relay to 127.0.0.1:``target_port`` that carries the client's bytes at ``rate`` bytes/s
    (a slow link), and the answers at full speed."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slow: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(64 << 10 if slow else 1 << 20):
                writer.write(chunk)
                await writer.drain()
                if slow:  # the link's rate itself, not a wait for anything
                    await asyncio.sleep(len(chunk) / rate)
        writer.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_a_message_longer_in_transit_than_the_timeout_is_not_cut(quick_timeout: float) -> None:
    """A call whose argument takes longer than the silence timeout to arrive (a slow link): the
    service hears bytes arriving on the connection (TCP), the caller hears the service's pings on
    the idle direction, and neither cuts it, as ZMTP's per-frame reset did not."""

    class Sink:
        async def size(self, blob: bytes) -> int:
            return len(blob)

    svc = Service(name="sink")
    svc.add(None, Sink())
    address = svc.bind("tcp://127.0.0.1:0")
    relay, port = await _relay(int(address.rsplit(":", 1)[1]), rate=8 << 20)
    links: list[bool] = []
    conn = Connection(f"tcp://127.0.0.1:{port}", None, name="slow link", on_link=links.append)
    try:
        blob = b"x" * (24 << 20)  # 3 s at 8 MiB/s: twice the 1.5 s timeout
        assert await wait_for(conn.call("size", (blob,), {}), 120) == len(blob)
        assert links == [True], links
    finally:
        conn.close()
        relay.close()
        await svc.close()


def test_bytes_received_on_a_tcp_connection_are_counted_and_a_hang_up_ends_it() -> None:
    """What the transport asks of a connection's socket (by its fd): how many bytes have arrived
    (TCP only), whether the peer in this host has read all we sent (ipc and TCP), and shutting it
    down; none of it touches a socket that replaced it."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    try:
        peer = peers.Peer(server.fileno(), 0.0)
        before = peer.received()
        assert before is not None
        client.sendall(b"y" * 1000)
        assert server.recv(1000, socket.MSG_WAITALL) == b"y" * 1000
        assert peer.received() == before + 1000
        assert peer.read_all()  # nothing sent to the other end
        server.sendall(b"z" * 10)
        assert not peer.read_all()  # sent, not read yet
        assert client.recv(10, socket.MSG_WAITALL) == b"z" * 10
        assert peer.read_all()
        assert peer.hang_up()
        assert client.recv(1) == b""  # the other end reads the end of the stream
        a, b = socket.socketpair()
        with a, b:
            unix = peers.Peer(a.fileno(), 0.0)
            assert unix.received() is None  # not TCP
            a.sendall(b"w" * 10)
            assert not unix.read_all()
            assert b.recv(10, socket.MSG_WAITALL) == b"w" * 10
            assert unix.read_all()
        stale = peers.Peer(server.fileno(), 0.0)
        stale.inode += 1  # as if the fd number now belonged to another socket
        assert stale.received() is None and not stale.hang_up()
    finally:
        for s in (client, server, listener):
            s.close()
