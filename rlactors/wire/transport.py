"""ZeroMQ sockets driven directly by the asyncio event loop.

Each socket is non-blocking and watched with ``loop.add_reader`` on its ZeroMQ file
descriptor (edge-triggered: after every wake-up or send we drain until ``EAGAIN``).
Outgoing envelopes queued during one turn of the loop are coalesced into one multipart
message per peer (see :mod:`protocols.runtime.wire`), which is where most of the throughput comes
from when many calls are in flight.

Nothing is dropped silently. ROUTER sockets set ``ROUTER_MANDATORY``, so ZeroMQ neither drops a
message to a peer that is gone nor one past a peer's high-water mark: the send fails with
``EHOSTUNREACH`` or ``EAGAIN`` instead. A message to a vanished peer is reported to the socket's
``on_undeliverable`` (the service logs a warning naming the actor and the methods whose replies
were lost). What ZeroMQ had already queued to a peer when its connection drops is discarded with
the connection, unseen here; the caller's side fails those calls (a DEALER's ``on_link``). A message past the high-water mark (:data:`SNDHWM` messages per peer held by ZeroMQ,
whose own queue counts messages, not bytes) waits in a per-peer backlog, in order, and is retried;
a peer that is slow or stopped holds up only its own messages. The backlog is bounded:
:meth:`AsyncSocket.full` says when a peer's backlog holds ``send_backlog_bytes`` or
:data:`SEND_BACKLOG_MESSAGES` messages, and senders that can wait (a service's replies and stream
items) ``await`` :meth:`AsyncSocket.room` before sending more, which holds them back until the peer
reads again (down to half the bound), or is disconnected (a stopped peer misses its heartbeats),
or the socket closes. ``send`` itself never refuses: a message sent past the bound by a sender that
cannot wait is queued too (the small control messages, errors, and a client's calls, whose callers
are held back by awaiting their results). The bound: ``RLACTORS_SEND_BACKLOG_BYTES`` (default
256 MiB per peer), ``send_backlog_bytes`` in cluster.toml's ``[cluster]``, or :func:`set_send_backlog`
for this process and the workers it starts.

Message size: every TCP socket sets ``ZMQ_MAXMSGSIZE`` to :data:`FRAME_BYTES` (plus CURVE's
overhead), so a peer that has not authenticated can make this process hold at most one such
frame before its handshake fails: a frame header declaring 4 GiB closes the connection at once.
Larger buffers travel as several frames of at most :data:`FRAME_BYTES` and are joined again on
arrival (a marker frame says how; one copy). Over ipc, whose sockets live in a folder only their
user can enter, frames travel whole (no copy). A whole message is bounded by ``max_message_bytes``
(``RLACTORS_MAX_MESSAGE_BYTES``, default 1 GiB): the sender refuses a bigger one with
:class:`~rlactors.base.errors.MessageTooLargeError`, and so does a receiver with a smaller bound.

Liveness: pings of our own on every connection, not ZMTP heartbeats. libzmq 4.3.5 can abort
(``Assertion failed: !_io_error (src/stream_engine_base.cpp:310)``, zeromq/libzmq#4364) when its
heartbeat timer, or a ZMTP PING from the peer, finds a connection that was closing while its peer
sent and then hung up; so no socket here sets ``ZMQ_HEARTBEAT_*``. Instead both ends of a
connection send a ping (a one-envelope ``PING`` message, call id 0, never passed on) every
:data:`HEARTBEAT_IVL_MS`: a DEALER to its peer once connected, a ROUTER to each peer that pings it.
Nothing answers a ping; everything received counts as hearing the peer, and so do two signs from
the kernel: bytes arriving on its TCP connection (a long message is heard before it is whole, as
each frame reset a ZMTP heartbeat's timeout), and, for a peer in this host, its having read all we
sent (its ZeroMQ I/O thread at work, which needs no GIL, as ZMTP's PONG did not). A connection
whose peer is silent for more than :data:`HEARTBEAT_TIMEOUT_MS` is cut, by either end:
``shutdown()`` of its socket, after which libzmq disconnects and, on the DEALER's side,
reconnects, as it did after a ZMTP heartbeat timed out. The DEALER's ``on_link``
callback hears of it, which is how callers notice a partition or a stopped process; the ROUTER's
messages to the peer then fail as undeliverable, and senders waiting in :meth:`AsyncSocket.room`
go on. Silence is measured in the loop's awake time (:mod:`rlactors.base.awake`).

A blocked loop still pings: one thread per process (``rlactors-pings``) watches every socket and,
for one whose loop has not run its liveness timer for :data:`STALL_S` (an async method that
blocks, a long GC), sends its pings. Every use of a ZeroMQ socket holds that socket's lock. So a
stopped process (SIGSTOP) goes silent, as with ZMTP, and a busy or blocked one does not. What ZMTP
did and this does not: a process on another host whose Python is held past the timeout by a C call
that keeps the GIL (a slow import of a large extension) looks silent there.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgpack
import numpy as np
import structlog
import zmq
from zmq.utils.monitor import parse_monitor_message

from protocols.runtime import wire
from rlactors.base.awake import AwakeClock, awake_clock
from rlactors.base.errors import MessageTooLargeError
from rlactors.base.logging import Throttle
from rlactors.wire.peers import Peer, inode
from rlactors.wire.security import Security

log = structlog.get_logger("rlactors.wire.transport")

# High-water marks, in messages per peer (each a batch of envelopes). ZeroMQ's queue to a peer counts
# messages, not bytes: it holds at most SNDHWM, then a bounded backlog of ours (see send_backlog_bytes).
SNDHWM = 100
HWM = 100_000  # receiving; callers also bound their in-flight calls
# A peer's backlog is full at this many messages (or send_backlog_bytes); senders that can wait
# resume at half of both.
SEND_BACKLOG_MESSAGES = 10_000
DEFAULT_SEND_BACKLOG_BYTES = 256 << 20
SEND_BACKLOG_BYTES_ENV = "RLACTORS_SEND_BACKLOG_BYTES"
RETRY_MIN_S = 0.001  # a full peer is retried after this, doubling while it makes no progress,
RETRY_MAX_S = 0.05  # up to this (it may be stopped until its connection is cut as silent)
# Messages read per wake-up before yielding to other callbacks (fairness).
DRAIN_BUDGET = 512
HEARTBEAT_IVL_MS = 1000  # a DEALER pings its peer this often; the liveness check runs this often
HEARTBEAT_TIMEOUT_MS = 6000  # a connection silent this long (awake time) is cut
# A loop that has not run its sockets' liveness timer for this long is stalled: the ping thread
# sends its pings.
STALL_S = 1.5
PING_TICK_S = 0.25  # how often the ping thread looks
REJECT_LOG_EVERY_S = 10.0  # peers refused by authentication: one log line per this many seconds
# The largest frame on the wire, and so the most memory a peer gets before authenticating; bigger
# buffers are cut into frames of this size. ZMQ_MAXMSGSIZE also counts CURVE's 33 bytes per frame.
FRAME_BYTES = 8 << 20
_MAXMSGSIZE = FRAME_BYTES + 64
_CHUNKED = b"\xc1"  # first byte of the marker frame of a message with cut frames (never starts msgpack)
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
MAX_MESSAGE_BYTES_ENV = "RLACTORS_MAX_MESSAGE_BYTES"


def _bound_from_env() -> int:
    raw = os.environ.get(MAX_MESSAGE_BYTES_ENV, "")
    try:
        value = int(raw) if raw else DEFAULT_MAX_MESSAGE_BYTES
    except ValueError:
        raise ValueError(f"{MAX_MESSAGE_BYTES_ENV} must be a number of bytes, got {raw!r}") from None
    if value < 1 << 20:
        raise ValueError(f"{MAX_MESSAGE_BYTES_ENV} must be at least 1 MiB (1048576), got {value}")
    return value


_max_message_bytes = _bound_from_env()


def max_message_bytes() -> int:
    """The largest message this process sends or accepts from an authenticated peer, in bytes."""
    return _max_message_bytes


def set_max_message_bytes(n: int) -> None:
    """Set the bound for this process and the workers it starts (through the environment)."""
    global _max_message_bytes
    os.environ[MAX_MESSAGE_BYTES_ENV] = str(int(n))
    _max_message_bytes = _bound_from_env()


def _backlog_from_env() -> int:
    raw = os.environ.get(SEND_BACKLOG_BYTES_ENV, "")
    try:
        value = int(raw) if raw else DEFAULT_SEND_BACKLOG_BYTES
    except ValueError:
        raise ValueError(f"{SEND_BACKLOG_BYTES_ENV} must be a number of bytes, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{SEND_BACKLOG_BYTES_ENV} must be positive, got {value}")
    return value


_send_backlog_bytes = _backlog_from_env()


def reload_from_env() -> None:
    """Read both bounds from the environment again (a process forked after this module was
    imported, with an environment of its own: see rlactors.node.forkserver)."""
    global _max_message_bytes, _send_backlog_bytes
    _max_message_bytes, _send_backlog_bytes = _bound_from_env(), _backlog_from_env()


def send_backlog_bytes() -> int:
    """How many bytes may wait, per peer, past ZeroMQ's queue before senders are held back."""
    return _send_backlog_bytes


def set_send_backlog(n_bytes: int) -> None:
    """Set the per-peer backlog bound for this process and the workers it starts (through the
    environment); sockets made later use it."""
    global _send_backlog_bytes
    os.environ[SEND_BACKLOG_BYTES_ENV] = str(int(n_bytes))
    _send_backlog_bytes = _backlog_from_env()


def nbytes(frame: Any) -> int:
    """Size of one outgoing or received frame."""
    if isinstance(frame, bytes):
        return len(frame)
    if isinstance(frame, memoryview):
        return frame.nbytes
    if isinstance(frame, zmq.Frame):
        return len(frame)
    return memoryview(frame).nbytes


def message_bytes(frames: Sequence[Any]) -> int:
    return sum(nbytes(f) for f in frames)


def check_size(frames: Sequence[Any], what: str) -> None:
    """Raise MessageTooLargeError if ``frames`` (one envelope) exceed ``max_message_bytes``."""
    size = message_bytes(frames)
    if size > _max_message_bytes:
        raise MessageTooLargeError(too_large(what, size, _max_message_bytes))


def too_large(what: str, size: int, bound: int) -> str:
    return (
        f"{what} is {size / 2**20:.1f} MiB, over max_message_bytes ({bound / 2**20:.1f} MiB); "
        f"send less per call, or raise the bound on every process of the cluster "
        f"({MAX_MESSAGE_BYTES_ENV}, or max_message_bytes in cluster.toml's [cluster])"
    )


def _cut(frames: Sequence[Any]) -> list[Any]:
    """Frames larger than FRAME_BYTES as pieces, after a marker frame listing the pieces of each."""
    for f in frames:
        if nbytes(f) > FRAME_BYTES:
            break
    else:
        return list(frames)
    sizes = [nbytes(f) for f in frames]
    counts, out = [], []
    for f, size in zip(frames, sizes, strict=True):
        if size <= FRAME_BYTES:
            counts.append(1)
            out.append(f)
            continue
        view = memoryview(f.buffer if isinstance(f, zmq.Frame) else f).cast("B")
        pieces = [view[i : i + FRAME_BYTES] for i in range(0, size, FRAME_BYTES)]
        counts.append(len(pieces))
        out.extend(pieces)
    return [_CHUNKED + msgpack.packb(counts), *out]


def _join(frames: list[Any]) -> list[Any]:
    """Undo :func:`_cut`: raises WireError if the marker does not match the frames."""
    try:
        counts = msgpack.unpackb(frames[0].bytes[1:])
    except Exception as e:  # bytes from a peer: msgpack raises several unrelated types on garbage
        raise wire.WireError(f"malformed frame marker: {type(e).__name__}") from e
    if (
        not isinstance(counts, list)
        or not all(isinstance(c, int) and c >= 1 for c in counts)
        or sum(counts) != len(frames) - 1
    ):
        raise wire.WireError("frame marker does not match the frames")
    out: list[Any] = []
    i = 1
    for c in counts:
        if c == 1:
            out.append(frames[i])
        else:  # one copy, into memory the decoded values may keep (np.concatenate: the fastest here)
            out.append(np.concatenate([np.frombuffer(f.buffer, np.uint8) for f in frames[i : i + c]]).data)
        i += c
    return out


_ctx: zmq.Context | None = None


def context() -> zmq.Context:
    """The process-wide ZeroMQ context."""
    global _ctx
    if _ctx is None or _ctx.closed:
        _ctx = zmq.Context.instance()
    return _ctx


OnMessage = Callable[[list[Any]], None]
# Told of messages to a peer that is gone: the peer's identity and the labels of their envelopes.
OnUndeliverable = Callable[[bytes | None, list[Any]], None]

_SENT, _FULL, _GONE = 0, 1, 2

# A liveness ping: a one-envelope message with call id 0 (no call's: ids start at 1), recognised
# here by its bytes and never passed on to a service or a client.
_PING = [bytes(f) for f in wire.join_batch([wire.encode_envelope(wire.Kind.PING, 0)])]


def _matches(frames: list[Any], k: int, message: list[bytes]) -> bool:
    """Whether ``frames[k:]`` is ``message`` (a ping)."""
    return (
        len(frames) == k + 2
        and len(frames[k + 1]) == len(message[1])
        and frames[k + 1].bytes == message[1]
        and frames[k].bytes == message[0]
    )


class _Backlog:
    """One peer's messages waiting past ZeroMQ's high-water mark, in order."""

    __slots__ = ("messages", "nbytes", "waiters")

    def __init__(self) -> None:
        self.messages: collections.deque[tuple[list[Any], Sequence[Any] | None, int]] = collections.deque()
        self.nbytes = 0
        self.waiters: list[asyncio.Future[None]] = []

    def add(self, frames: list[Any], about: Sequence[Any] | None) -> None:
        size = message_bytes(frames)
        self.messages.append((frames, about, size))
        self.nbytes += size

    def full(self, max_bytes: int) -> bool:
        return self.nbytes >= max_bytes or len(self.messages) >= SEND_BACKLOG_MESSAGES

    def roomy(self, max_bytes: int) -> bool:
        return self.nbytes <= max_bytes // 2 and len(self.messages) <= SEND_BACKLOG_MESSAGES // 2


class AsyncSocket:
    """A ZeroMQ socket served by the running loop, with batched sends.

    ``on_message`` receives each incoming multipart message (a list of ``zmq.Frame``).
    For ROUTER sockets the first frame is the peer identity.

    Sending: see the module's docstring. ``on_undeliverable(peer, labels)`` hears of messages
    to a peer that is gone (ROUTER only), with the labels (``about``) they were sent with;
    without it they are logged at warning.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        on_message: OnMessage,
        *,
        name: str = "",
        on_too_large: Callable[[list[Any], str], None] | None = None,
        whole_frames: bool = False,
        liveness: bool = False,
    ) -> None:
        self.sock = sock
        self.name = name
        self._on_message = on_message
        # Told of a message over max_message_bytes (its frames, joined, and why), instead of on_message.
        self._on_too_large = on_too_large
        self.on_undeliverable: OnUndeliverable | None = None
        self._skip = 1 if sock.type == zmq.ROUTER else 0  # the peer's identity frame
        self._whole = whole_frames  # send frames uncut (ipc: no stranger can connect)
        self._size_log = Throttle(log, "refused a message over max_message_bytes", REJECT_LOG_EVERY_S)
        self._loop = asyncio.get_running_loop()
        self._fd = sock.fileno()
        # Per peer (its identity; None for a DEALER's one peer), only while it has a backlog.
        self._backlogs: dict[bytes | None, _Backlog] = {}
        self.backlog_bytes = _send_backlog_bytes  # a peer's backlog is full at this many bytes
        self._retry_handle: asyncio.TimerHandle | None = None
        self._retry_s = RETRY_MIN_S
        self._drain_scheduled = False
        self.closed = False
        self.monitor: AsyncSocket | None = None  # failed handshakes of a secured ROUTER (watch_handshakes)
        # Liveness (see the module's docstring). Every use of the ZeroMQ socket holds _lock: the ping
        # thread sends on it too while this loop is stalled.
        self._lock = threading.Lock()
        self.seen = time.monotonic()  # when this loop last ran the liveness timer
        self._clock: AwakeClock | None = None
        self._tick_handle: asyncio.TimerHandle | None = None
        self._peers: dict[bytes, Peer] = {}  # ROUTER: its connections, by peer identity
        self._connecting: tuple[int, int] = (-1, -1)  # DEALER: (fd, inode) of the connection made last
        self._link: Peer | None = None  # DEALER: its connection, while it is up
        self._pinged = 0.0  # monotonic time of the last pings
        self._wake_pending = False  # the ping thread has asked this loop to drain
        if liveness:
            self._clock = awake_clock()
            self._tick_handle = self._loop.call_later(HEARTBEAT_IVL_MS / 1000, self._tick)
            _pinger.watch(self)
        self._loop.add_reader(self._fd, self._on_readable)
        # Messages may already be queued before we started watching.
        self._schedule_drain()

    # --- receiving -----------------------------------------------------------------------------

    def _on_readable(self) -> None:
        if self._backlogs:
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
        sock, lock = self.sock, self._lock
        heard: float | None = None  # awake time, read at the first message
        try:
            for _ in range(DRAIN_BUDGET):
                with lock:
                    if self.closed:
                        return
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        return
                    except zmq.ZMQError as e:
                        log.warning("recv failed", socket=self.name, error=str(e))
                        return
                if self._clock is not None:
                    if heard is None:
                        heard = self._clock.now()
                    if self._skip:
                        if self._heard_from(frames, heard):
                            continue
                    elif _matches(frames, 0, _PING):
                        continue
                try:
                    self._receive(frames)
                except Exception:  # one bad message must not stop the socket's reader
                    log.exception("message handler failed; message dropped", socket=self.name)
            # Budget spent: come back after other callbacks had their turn.
            self._schedule_drain()
        finally:
            if heard is not None and self._link is not None:
                self._link.heard = heard

    # --- liveness (see the module's docstring) ----------------------------------------------------

    def _heard_from(self, frames: list[Any], now: float) -> bool:
        """ROUTER: note that the peer spoke; True if it was a ping (nothing else to do with it)."""
        ident = frames[0].bytes
        peer = self._peers.get(ident)
        if peer is None:
            fd = frames[0].get(zmq.SRCFD)
            peer = self._peers[ident] = Peer(fd if isinstance(fd, int) else -1, now)
        else:
            peer.heard = now
        if not _matches(frames, 1, _PING):
            return False
        peer.pings = True  # one of ours: it is pinged back (a raw ZeroMQ peer is not)
        return True

    def _ping(self) -> None:
        """Ping the peer (DEALER, while connected) or every peer that pings (ROUTER), the lock
        held. A peer at its high-water mark goes without this time: it is not reading."""
        if self.closed:
            return
        self._pinged = time.monotonic()
        if not self._skip:
            if self._link is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self.sock.send_multipart(_PING, zmq.NOBLOCK)
            return
        for ident, peer in list(self._peers.items()):
            if peer.pings:
                with contextlib.suppress(zmq.ZMQError):  # gone: EHOSTUNREACH, and it ages out
                    self.sock.send_multipart([ident, *_PING], zmq.NOBLOCK)

    def _linked(self, up: bool) -> None:
        """DEALER: its connection came up (handshake done) or went down."""
        self._link = None
        if up and self._clock is not None:
            self._link = Peer(self._connecting, self._clock.now())
            with self._lock:  # a new identity at the ROUTER: it learns at once that this one pings
                self._ping()

    def _silent(self, peer: Peer, now: float, pinged: bool) -> bool:
        """Whether ``peer`` has been silent past the timeout. Two signs from the kernel count as
        hearing it too, as they did for ZMTP heartbeats: bytes arriving on its TCP connection (a
        long message, heard only when whole; each frame reset ZMTP's timeout), and, for a peer in
        this host that we ping (``pinged``), its having read every byte we sent, our last ping
        included: that is its ZeroMQ I/O thread at work, which needs no GIL (ZMTP's PONG came from
        it), so a peer whose Python is held up by a long C call, an import, is not cut."""
        silent = now - peer.heard
        if silent > 2 * HEARTBEAT_IVL_MS / 1000:
            rx = peer.received()
            if (rx is not None and rx != peer.rx) or (pinged and peer.read_all()):
                peer.heard = now
                if rx is not None:
                    peer.rx = rx
                return False
        return silent > HEARTBEAT_TIMEOUT_MS / 1000

    def _cut(self, peer: Peer, now: float) -> None:
        if peer.hang_up():
            log.info(
                "cut a connection whose peer was silent",
                socket=self.name,
                silent_s=round(now - peer.heard, 1),
            )

    def _tick(self) -> None:
        """Every HEARTBEAT_IVL_MS on the loop: ping, and cut connections silent past the timeout."""
        self._tick_handle = None
        if self.closed or self._clock is None:
            return
        self.seen = time.monotonic()
        now = self._clock.now()  # judged before this round's pings: the last ones are a second old
        if self._skip:
            for ident, peer in list(self._peers.items()):
                if self._silent(peer, now, peer.pings):  # silent, or gone (a closed one is not cut)
                    del self._peers[ident]
                    self._cut(peer, now)
        elif self._link is not None and self._silent(self._link, now, True):
            peer, self._link = self._link, None
            self._cut(peer, now)
        with self._lock:
            self._ping()
            if not self.closed and cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                self._schedule_drain()  # the send may have taken the fd's edge
        self._tick_handle = self._loop.call_later(HEARTBEAT_IVL_MS / 1000, self._tick)

    def _ping_stalled(self) -> None:
        """From the ping thread, while this socket's loop is stalled: send its pings (what arrives
        waits for the loop; its own judgement waits too, in awake time)."""
        with self._lock:
            if not self.closed and time.monotonic() - self._pinged >= HEARTBEAT_IVL_MS / 1000:
                self._ping()
                wake = True
            else:
                wake = False
        # The send may have taken the fd's edge: the loop drains when it wakes (one callback per stall).
        if wake and not self._wake_pending:
            self._wake_pending = True
            with contextlib.suppress(RuntimeError):  # its loop is closed
                self._loop.call_soon_threadsafe(self._woken)

    def _woken(self) -> None:
        self._wake_pending = False
        self._schedule_drain()

    def _receive(self, frames: list[Any]) -> None:
        k = self._skip
        size = 0
        if self._whole or (len(frames) - k) * _MAXMSGSIZE > _max_message_bytes:  # else within the bound
            size = message_bytes(frames[k:])
        if len(frames) > k and len(frames[k]) and frames[k].buffer[0] == _CHUNKED[0]:
            try:
                frames = frames[:k] + _join(frames[k:])
            except wire.WireError as e:
                self._size_log(socket=self.name, why=str(e))
                return
        if size > _max_message_bytes:
            why = too_large("the message", size, _max_message_bytes)
            self._size_log(socket=self.name, why=why)
            if self._on_too_large is not None:
                self._on_too_large(frames, why)
            return
        self._on_message(frames)

    # --- sending -------------------------------------------------------------------------------

    def send(self, frames: Sequence[Any], about: Sequence[Any] | None = None) -> None:
        """Send one multipart message now, or queue it behind the peer's backlog (never refused).

        ``about``: labels of the message's envelopes, for ``on_undeliverable``.
        """
        if self.closed:
            raise ConnectionError(f"socket {self.name} is closed")
        if self._whole:
            frames = list(frames)
        elif self._skip:
            frames = [frames[0], *_cut(frames[1:])]
        else:
            frames = _cut(frames)
        if self._backlogs:
            backlog = self._backlogs.get(frames[0] if self._skip else None)
            if backlog is not None:  # keep the peer's order
                backlog.add(frames, about)
                return
        outcome = self._try_send(frames)
        if outcome == _FULL:
            self._queue(frames, about)
        elif outcome == _GONE:
            self._undeliverable(frames[0], [about])

    def full(self, to: bytes | None = None) -> bool:
        """Whether the backlog to peer ``to`` (None: a DEALER's peer) is at its bound."""
        if not self._backlogs:
            return False
        backlog = self._backlogs.get(to)
        return backlog is not None and backlog.full(self.backlog_bytes)

    async def room(self, to: bytes | None = None) -> None:
        """Wait until the backlog to ``to`` is down to half its bound, the peer is gone, or the
        socket closed. No timeout: a stopped peer's connection is cut once it has been silent for
        HEARTBEAT_TIMEOUT_MS."""
        while not self.closed and self.full(to):
            waiter = self._loop.create_future()
            self._backlogs[to].waiters.append(waiter)
            await waiter

    def backlog(self, to: bytes | None = None) -> tuple[int, int]:
        """(messages, bytes) waiting in the backlog to ``to``."""
        b = self._backlogs.get(to)
        return (len(b.messages), b.nbytes) if b is not None else (0, 0)

    def _try_send(self, frames: Sequence[Any]) -> int:
        with self._lock:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # the peer's high-water mark (ROUTER_MANDATORY says so rather than drop)
                return _FULL
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:  # ROUTER_MANDATORY: the peer has gone away
                    return _GONE
                raise
            finally:
                # A send can consume the fd's edge for pending input: check explicitly.
                if (
                    not self.closed and cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN
                ):  # an int option
                    self._schedule_drain()
            return _SENT

    def _queue(self, frames: list[Any], about: Sequence[Any] | None) -> None:
        key = frames[0] if self._skip else None
        backlog = self._backlogs.get(key)
        if backlog is None:
            backlog = self._backlogs[key] = _Backlog()
        backlog.add(frames, about)
        self._arm_retry()

    def _undeliverable(self, peer: bytes | None, abouts: list[Sequence[Any] | None]) -> None:
        labels = [label for about in abouts if about is not None for label in about]
        if self.on_undeliverable is not None:
            self.on_undeliverable(peer, labels)
        else:
            log.warning("message not delivered: its peer is gone", socket=self.name, about=labels)

    def _arm_retry(self) -> None:
        if self._retry_handle is None and not self.closed:
            self._retry_handle = self._loop.call_later(self._retry_s, self._retry)

    def _retry(self) -> None:
        self._retry_handle = None
        self._flush_backlog()

    def _flush_backlog(self) -> None:
        """Send what each peer's backlog holds, in order, until its high-water mark."""
        progress = False
        for key, backlog in list(self._backlogs.items()):
            messages = backlog.messages
            while messages and not self.closed:
                frames, _, size = messages[0]
                outcome = self._try_send(frames)
                if outcome == _FULL:
                    break
                progress = True
                if outcome == _GONE:  # the rest cannot go either
                    self._undeliverable(key, [m[1] for m in messages])
                    messages.clear()
                    backlog.nbytes = 0
                    break
                messages.popleft()
                backlog.nbytes -= size
            if not messages:
                del self._backlogs[key]
            if backlog.waiters and (not messages or backlog.roomy(self.backlog_bytes)):
                _wake(backlog)
        if self._backlogs:
            self._retry_s = RETRY_MIN_S if progress else min(self._retry_s * 2, RETRY_MAX_S)
            self._arm_retry()
        else:
            self._retry_s = RETRY_MIN_S

    def close(self, linger: int = 0) -> None:
        if self.closed:
            return
        self.closed = True
        for handle in (self._retry_handle, self._tick_handle):
            if handle is not None:
                handle.cancel()
        self._peers.clear()
        for backlog in self._backlogs.values():
            # Not a warning: the peers learn of the close (a client has failed its calls already).
            log.info(
                "socket closed with messages not sent",
                socket=self.name,
                messages=len(backlog.messages),
                about=[label for m in backlog.messages if m[1] is not None for label in m[1]][:20],
            )
            _wake(backlog)
        self._backlogs.clear()
        try:
            self._loop.remove_reader(self._fd)
        except (RuntimeError, ValueError):  # loop already closed
            pass
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.monitor.close()
        with self._lock:
            self.sock.close(linger=linger)


def _wake(backlog: _Backlog) -> None:
    for waiter in backlog.waiters:
        if not waiter.done():
            waiter.set_result(None)
    backlog.waiters.clear()


class Outbox:
    """Collects envelopes per destination during one loop turn and sends each batch once.

    ``about`` labels an envelope (a service passes the method a reply answers); a message that
    cannot be delivered reports its envelopes' labels to the socket's ``on_undeliverable``.
    """

    def __init__(self, asock: AsyncSocket, *, routed: bool) -> None:
        self._asock = asock
        self._routed = routed
        self._pending: dict[bytes | None, tuple[list[list[Any]], list[Any]]] = {}
        self._scheduled = False
        self._loop = asyncio.get_running_loop()

    def put(self, envelope: list[Any], to: bytes | None = None, about: Any = None) -> None:
        pending = self._pending.get(to)
        if pending is None:
            self._pending[to] = ([envelope], [about])
        else:
            pending[0].append(envelope)
            pending[1].append(about)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, {}
        if self._asock.closed:
            if pending:  # put after its owner closed it (calls cancelled at shutdown answering)
                log.debug("socket closed; messages not sent", socket=self._asock.name, messages=len(pending))
            return
        for to, (envelopes, abouts) in pending.items():
            spans = _spans(envelopes)
            if len(spans) == 1:  # the usual case: no copies of the lists
                msg = wire.join_batch(envelopes)
                self._asock.send([to, *msg] if self._routed else msg, abouts)
                continue
            for i, j in spans:
                msg = wire.join_batch(envelopes[i:j])
                self._asock.send([to, *msg] if self._routed else msg, abouts[i:j])


def _spans(envelopes: list[list[Any]]) -> list[tuple[int, int]]:
    """Slices of ``envelopes`` to send as one message each: at most MAX_ENVELOPES_PER_MESSAGE and,
    where an envelope is large, at most max_message_bytes together (each alone was checked by its
    sender)."""
    if len(envelopes) == 1:
        return [(0, 1)]
    out: list[tuple[int, int]] = []
    start = size = 0
    for i, env in enumerate(envelopes):
        n = message_bytes(env)
        if i > start and (i - start == wire.MAX_ENVELOPES_PER_MESSAGE or size + n > _max_message_bytes):
            out.append((start, i))
            start, size = i, 0
        size += n
    out.append((start, len(envelopes)))
    return out


def _whole_frames(address: str) -> bool:
    """Whether frames to and from ``address`` travel uncut: ipc only (see the module's docstring)."""
    return address.startswith("ipc://")


def _configure(sock: zmq.Socket, whole_frames: bool) -> None:
    sock.setsockopt(zmq.SNDHWM, SNDHWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.LINGER, 0)
    # Before authentication a peer can make us hold one frame: keep that small (see FRAME_BYTES).
    # Over ipc only our own user can connect; max_message_bytes is checked on arrival.
    sock.setsockopt(zmq.MAXMSGSIZE, -1 if whole_frames else _MAXMSGSIZE)
    # No ZMTP heartbeats (ZMQ_HEARTBEAT_IVL stays 0 on every socket, so no peer sends ZMTP PINGs
    # either): libzmq 4.3.5 can abort in them (zeromq/libzmq#4364). Liveness is our pings.


def monitor(asock: AsyncSocket, events: int, on_event: Callable[[int, str], None]) -> None:
    """Call ``on_event(event, endpoint)`` for the socket's connection ``events`` (ZeroMQ's monitor)."""

    def handle(frames: list[Any]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        on_event(event["event"], event["endpoint"].decode(errors="replace"))

    asock.monitor = AsyncSocket(asock.sock.get_monitor_socket(events), handle, name=f"{asock.name}-monitor")


def bind_router(
    address: str,
    on_message: OnMessage,
    security: Security | None,
    *,
    name: str,
    on_too_large: Callable[[list[Any], str], None] | None = None,
) -> tuple[AsyncSocket, str]:
    """Bind a ROUTER socket; returns it and the concrete address (with the chosen port)."""
    sock = context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    whole = _whole_frames(address)
    _configure(sock, whole)
    if security is not None:
        security.apply_server(sock)
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    sock.bind(address)
    concrete = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    asock = AsyncSocket(
        sock, on_message, name=name, on_too_large=on_too_large, whole_frames=whole, liveness=True
    )
    if security is not None:
        _log_rejections(asock)
    return asock, concrete


_HANDSHAKE_FAILED: dict[int, str] = {
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
    on_too_large: Callable[[list[Any], str], None] | None = None,
) -> AsyncSocket:
    """Connect a DEALER socket to a ROUTER at ``address``.

    ``on_link(True)`` is called when a connection is established (handshake done),
    ``on_link(False)`` when it is lost (peer gone, or its connection cut: silent past
    HEARTBEAT_TIMEOUT_MS).
    """
    sock = context().socket(zmq.DEALER)
    whole = _whole_frames(address)
    _configure(sock, whole)
    sock.setsockopt(zmq.IMMEDIATE, 0)
    # A connection attempt into a partition gives up and retries, so the link is back soon after it heals.
    sock.setsockopt(zmq.CONNECT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    if security is not None:
        security.apply_client(sock)
    asock = AsyncSocket(
        sock, on_message, name=name, on_too_large=on_too_large, whole_frames=whole, liveness=True
    )

    def on_event(frames: list[Any]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        kind = event["event"]
        if kind == zmq.EVENT_CONNECTED:  # its value is the connection's fd
            fd = int(event["value"])
            asock._connecting = (fd, inode(fd))
            return
        up = kind == zmq.EVENT_HANDSHAKE_SUCCEEDED
        asock._linked(up)
        if on_link is not None:
            on_link(up)

    events = zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
    asock.monitor = AsyncSocket(sock.get_monitor_socket(events), on_event, name=f"{name}-monitor")
    sock.connect(address)
    # The first message on the connection, ahead of any call: the ROUTER knows this peer pings (and
    # pings it back) before it reads anything else from it.
    with contextlib.suppress(zmq.ZMQError):
        sock.send_multipart(_PING, zmq.NOBLOCK)
    return asock


class _Pinger:
    """The process's ping thread: pings for sockets whose loop is stalled (see the module's
    docstring). Started with the first socket; a forked child starts its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: weakref.WeakSet[AsyncSocket] = weakref.WeakSet()
        self._pid: int | None = None

    def watch(self, asock: AsyncSocket) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(
                    target=self._run, args=(self._pid,), name="rlactors-pings", daemon=True
                ).start()
            self._sockets.add(asock)

    def forked(self) -> None:
        """In a forked child: the parent's thread, sockets and lock state are not ours."""
        self._lock = threading.Lock()
        self._sockets = weakref.WeakSet()
        self._pid = None

    def _run(self, pid: int) -> None:
        while self._pid == pid:
            time.sleep(PING_TICK_S)
            with self._lock:
                sockets = list(self._sockets)
            now = time.monotonic()
            for asock in sockets:
                if not asock.closed and now - asock.seen > STALL_S:
                    try:
                        asock._ping_stalled()
                    except Exception:  # a socket closed under it: the next round skips it
                        log.debug("ping thread skipped a socket", socket=asock.name, exc_info=True)


_pinger = _Pinger()
os.register_at_fork(after_in_child=_pinger.forked)
