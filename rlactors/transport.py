"""ZeroMQ sockets driven directly by the asyncio event loop.

Each socket is non-blocking and watched with ``loop.add_reader`` on its ZeroMQ file
descriptor (edge-triggered: after every wake-up or send we drain until ``EAGAIN``).
Outgoing envelopes queued during one turn of the loop are coalesced into one multipart
message per peer (see :mod:`protocols.wire`), which is where most of the throughput comes
from when many calls are in flight.

ROUTER sockets set ``ROUTER_MANDATORY``: a reply to a peer that is gone raises instead of
vanishing, and is logged. When ZeroMQ's high-water mark is reached, messages wait in a
local backlog and are retried; nothing is dropped silently.

Every connection carries ZMTP heartbeats (answered by ZeroMQ's I/O thread, not the event
loop): a peer silent for ``HEARTBEAT_IVL_MS + HEARTBEAT_TIMEOUT_MS`` is disconnected, and
a DEALER's ``on_link`` callback hears of it, which is how callers notice a partition.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import zmq
from zmq.utils.monitor import parse_monitor_message

from protocols import wire
from rlactors.logging import Throttle
from rlactors.security import Security

log = structlog.get_logger("rlactors.transport")

# Per-socket high-water mark, in messages. Callers also bound their in-flight calls.
HWM = 100_000
# Messages read per wake-up before yielding to other callbacks (fairness).
DRAIN_BUDGET = 512
HEARTBEAT_IVL_MS = 1000  # ZMTP ping to every peer this often
HEARTBEAT_TIMEOUT_MS = 6000  # a connection silent this long after a ping is dropped
REJECT_LOG_EVERY_S = 10.0  # peers refused by authentication: one log line per this many seconds

_ctx: zmq.Context | None = None


def context() -> zmq.Context:
    """The process-wide ZeroMQ context."""
    global _ctx
    if _ctx is None or _ctx.closed:
        _ctx = zmq.Context.instance()
    return _ctx


OnMessage = Callable[[list[Any]], None]


class AsyncSocket:
    """A ZeroMQ socket served by the running loop, with batched sends.

    ``on_message`` receives each incoming multipart message (a list of ``zmq.Frame``).
    For ROUTER sockets the first frame is the peer identity.
    """

    def __init__(self, sock: zmq.Socket, on_message: OnMessage, *, name: str = "") -> None:
        self.sock = sock
        self.name = name
        self._on_message = on_message
        self._loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._backlog: collections.deque[list[Any]] = collections.deque()
        self._retry_handle: asyncio.TimerHandle | None = None
        self._drain_scheduled = False
        self.closed = False
        self.monitor: AsyncSocket | None = None  # failed handshakes of a secured ROUTER (watch_handshakes)
        self._loop.add_reader(self._fd, self._on_readable)
        # Messages may already be queued before we started watching.
        self._schedule_drain()

    # --- receiving -----------------------------------------------------------------------------

    def _on_readable(self) -> None:
        if self._backlog:
            self._flush_backlog()
        self._drain()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and not self.closed:
            self._drain_scheduled = True
            self._loop.call_soon(self._scheduled_drain)

    def _scheduled_drain(self) -> None:
        self._drain_scheduled = False
        self._drain()

    def _drain(self) -> None:
        sock = self.sock
        for _ in range(DRAIN_BUDGET):
            if self.closed:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                if self.closed:
                    return
                log.warning("recv failed", socket=self.name, error=str(e))
                return
            try:
                self._on_message(frames)
            except Exception:
                log.exception("message handler failed; message dropped", socket=self.name)
        # Budget spent: come back after other callbacks had their turn.
        self._schedule_drain()

    # --- sending -------------------------------------------------------------------------------

    def send(self, frames: Sequence[Any]) -> None:
        """Send one multipart message now, or queue it behind earlier ones at the high-water mark."""
        if self.closed:
            raise ConnectionError(f"socket {self.name} is closed")
        if self._backlog:
            self._backlog.append(list(frames))
            return
        self._send_now(frames)

    def _send_now(self, frames: Sequence[Any]) -> bool:
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._backlog.append(list(frames))
            self._arm_retry()
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                # ROUTER_MANDATORY: the peer has gone away; its reply has nowhere to go.
                log.debug("peer unreachable; message not delivered", socket=self.name)
                return True
            raise
        finally:
            # A send can consume the fd's edge for pending input: check explicitly.
            if not self.closed and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._schedule_drain()
        return True

    def _arm_retry(self) -> None:
        if self._retry_handle is None and not self.closed:
            self._retry_handle = self._loop.call_later(0.001, self._retry)

    def _retry(self) -> None:
        self._retry_handle = None
        self._flush_backlog()

    def _flush_backlog(self) -> None:
        while self._backlog and not self.closed:
            frames = self._backlog.popleft()
            if not self._send_now(frames):
                # _send_now re-queued it at the back; restore order.
                self._backlog.rotate(1)
                return

    def close(self, linger: int = 0) -> None:
        if self.closed:
            return
        self.closed = True
        if self._retry_handle is not None:
            self._retry_handle.cancel()
        try:
            self._loop.remove_reader(self._fd)
        except (RuntimeError, ValueError):  # loop already closed
            pass
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.monitor.close()
        self.sock.close(linger=linger)


class Outbox:
    """Collects envelopes per destination during one loop turn and sends each batch once."""

    def __init__(self, asock: AsyncSocket, *, routed: bool) -> None:
        self._asock = asock
        self._routed = routed
        self._pending: dict[bytes | None, list[list[Any]]] = {}
        self._scheduled = False
        self._loop = asyncio.get_running_loop()

    def put(self, envelope: list[Any], to: bytes | None = None) -> None:
        batch = self._pending.get(to)
        if batch is None:
            self._pending[to] = [envelope]
        else:
            batch.append(envelope)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, {}
        if self._asock.closed:
            return
        for to, envelopes in pending.items():
            for i in range(0, len(envelopes), wire.MAX_ENVELOPES_PER_MESSAGE):
                msg = wire.join_batch(envelopes[i : i + wire.MAX_ENVELOPES_PER_MESSAGE])
                self._asock.send([to, *msg] if self._routed else msg)


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.LINGER, 0)
    # ZMTP heartbeats are answered by ZeroMQ's I/O thread, so a busy event loop still answers them;
    # a peer that stays silent is disconnected, which the caller turns into failed calls.
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def monitor(asock: AsyncSocket, events: int, on_event: Callable[[int, str], None]) -> None:
    """Call ``on_event(event, endpoint)`` for the socket's connection ``events`` (ZeroMQ's monitor)."""

    def handle(frames: list[Any]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        on_event(event["event"], event["endpoint"].decode(errors="replace"))

    asock.monitor = AsyncSocket(asock.sock.get_monitor_socket(events), handle, name=f"{asock.name}-monitor")


def bind_router(
    address: str, on_message: OnMessage, security: Security | None, *, name: str
) -> tuple[AsyncSocket, str]:
    """Bind a ROUTER socket; returns it and the concrete address (with the chosen port)."""
    sock = context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    _configure(sock)
    if security is not None:
        security.apply_server(sock)
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    sock.bind(address)
    concrete = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    asock = AsyncSocket(sock, on_message, name=name)
    if security is not None:
        _log_rejections(asock)
    return asock, concrete


_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its credentials were refused",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "its handshake failed (wrong key or secret, or no security)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "its handshake failed",
}


def _log_rejections(asock: AsyncSocket) -> None:
    """Log peers refused by authentication (ZeroMQ drops them silently), a few lines per flood."""
    rejected = Throttle(log, "rejected a peer that did not authenticate", REJECT_LOG_EVERY_S)

    def on_event(event: int, endpoint: str) -> None:
        why = _HANDSHAKE_FAILED.get(event, "its handshake failed")
        rejected(socket=asock.name, endpoint=endpoint, why=why)

    monitor(asock, functools.reduce(operator.or_, _HANDSHAKE_FAILED), on_event)


def connect_dealer(
    address: str,
    on_message: OnMessage,
    security: Security | None,
    *,
    name: str,
    on_link: Callable[[bool], None] | None = None,
) -> AsyncSocket:
    """Connect a DEALER socket to a ROUTER at ``address``.

    ``on_link(True)`` is called when a connection is established (handshake done),
    ``on_link(False)`` when it is lost (peer gone, or silent past the heartbeat timeout).
    """
    sock = context().socket(zmq.DEALER)
    _configure(sock)
    sock.setsockopt(zmq.IMMEDIATE, 0)
    # A connection attempt into a partition gives up and retries, so the link is back soon after it heals.
    sock.setsockopt(zmq.CONNECT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    if security is not None:
        security.apply_client(sock)
    asock = AsyncSocket(sock, on_message, name=name)
    if on_link is not None:
        monitor(
            asock,
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED,
            lambda event, _: on_link(event == zmq.EVENT_HANDSHAKE_SUCCEEDED),
        )
    sock.connect(address)
    return asock
