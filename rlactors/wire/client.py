"""The calling side: one DEALER connection per remote service, and the process's runtime client.

A :class:`Connection` sends CALLs to one address and matches replies to futures by call id.
Calls are sent when they are made (not when awaited), so calls from one caller to one
actor arrive in the order they were made. In-flight calls per connection are bounded;
beyond the window they wait locally, in order.

The :class:`RuntimeClient` owns the connections of this process, the connection to the
head, and a subscription to the head's actor-state events: when an actor dies, every
call pending on it fails with :class:`ActorDiedError` at once, and later calls fail
immediately (or wait for the restarted actor, if it is restarting).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog

from protocols.runtime import wire
from protocols.runtime.wire import Flags, Kind
from rlactors.base.awake import AwakeTimer, awake_clock
from rlactors.base.errors import (
    ActorDiedError,
    ActorUnreachableError,
    MessageTooLargeError,
    RuntimeShutdownError,
    exception_from_payload,
)
from rlactors.base.forensics import CURRENT_CALL
from rlactors.base.logging import Throttle
from rlactors.wire.security import Security
from rlactors.wire.transport import HEARTBEAT_TIMEOUT_MS, AsyncSocket, Outbox, check_size, connect_dealer

log = structlog.get_logger("rlactors.wire.client")

MAX_IN_FLIGHT = 65_536
STREAM_ACK_EVERY = 64
LOG_EVERY_S = 10.0  # a flood of undecodable replies logs one line per this many seconds
# After a connection is lost, its pending calls fail this much later: the head's word that the
# actor died (ActorDiedError with the reason) usually comes first. Partition bound: ping
# interval + silence timeout (HEARTBEAT_IVL_MS + HEARTBEAT_TIMEOUT_MS, rlactors.wire.transport) + this.
LINK_GRACE_S = 3.0


Args = tuple[Any, ...] | list[Any] | wire.EncodedArgs


def _call_envelope(
    call_id: int, target: str | None, method: str, args: Args, kwargs: dict[str, Any], flags: int
) -> list[Any]:
    if isinstance(args, wire.EncodedArgs):
        return wire.encode_call(call_id, target, method, args, flags)
    return wire.encode_envelope(Kind.CALL, call_id, target, method, list(args), kwargs, flags)


class StreamCall(AsyncIterator[Any]):
    """The caller's end of a streaming method: ``async for item in handle.gen(...)``."""

    def __init__(self, conn: Connection | None, call_id: int) -> None:
        self._conn = conn
        self._call_id = call_id
        self._items: collections.deque[Any] = collections.deque()
        self._wake = asyncio.Event()
        self._done = False
        self._error: BaseException | None = None
        self._consumed = 0

    def _push(self, item: Any) -> None:
        self._items.append(item)
        self._wake.set()

    def _finish(self, error: BaseException | None = None) -> None:
        if self._conn is not None:
            self._conn._sent.pop(self._call_id, None)
        self._done = True
        self._error = error
        self._wake.set()

    def __aiter__(self) -> StreamCall:
        return self

    async def __anext__(self) -> Any:
        while not self._items:
            if self._done:
                if self._error is not None:
                    err, self._error = self._error, None
                    raise err
                raise StopAsyncIteration
            self._wake.clear()
            try:
                await self._wake.wait()
            except asyncio.CancelledError:
                await self.aclose()
                raise
        self._consumed += 1
        if self._consumed % STREAM_ACK_EVERY == 0 and not self._done and self._conn is not None:
            self._conn._put(wire.encode_envelope(Kind.STREAM_ACK, self._call_id, self._consumed))
        return self._items.popleft()

    async def aclose(self) -> None:
        """Stop the stream early; the remote generator is cancelled."""
        self._abandon()

    def cancel(self) -> None:
        """End the stream now: the remote generator is cancelled and iteration stops."""
        self._abandon()
        self._finish()

    def _abandon(self) -> None:
        if not self._done:
            self._done = True
            if self._conn is not None:
                self._conn._cancel(self._call_id)

    def __del__(self) -> None:
        # `async for ...: break` never calls aclose(): cancel the remote generator when we are dropped.
        try:
            self._abandon()
        except Exception:  # the loop may be closed at interpreter exit
            pass

    async def __aenter__(self) -> StreamCall:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._abandon()


class Connection:
    """A DEALER socket to one service address, with its pending calls."""

    def __init__(
        self,
        address: str,
        security: Security | None,
        *,
        name: str = "",
        on_link: Callable[[bool], None] | None = None,
        first_link_within: float | None = None,
    ) -> None:
        """``first_link_within``: seconds the first connection may take before calls fail with
        ActorUnreachableError as after a lost one (None: wait; for a peer that may not be up yet)."""
        self.address = address
        self.name = name or address
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any] | StreamCall] = {}
        # pending call -> (method, target, when sent, the incoming method it was made from)
        self._sent: dict[int, tuple[str, str | None, float, str | None]] = {}
        self.peer: tuple[str, str | None] | None = None  # (actor id, name) when the peer is an actor
        self._waiting: collections.deque[list[Any]] = collections.deque()
        self._closed_error: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self._link_down = False  # the connection was lost and is not back yet
        self._at_risk: set[int] = set()  # calls pending when it was lost: their replies are gone
        self._link_timer: AwakeTimer | None = None  # timers count awake time (rlactors.base.awake)
        self._unreachable: ActorUnreachableError | None = None  # set while the peer stays unreachable
        self._link_up = asyncio.Event()  # set while the connection is established
        self._link_hook = on_link
        self._asock: AsyncSocket = connect_dealer(
            address,
            self._on_message,
            security,
            name=self.name,
            on_link=self._on_link,
            on_too_large=self._on_too_large,
        )
        self._outbox = Outbox(self._asock, routed=False)
        self._connect_timer: AwakeTimer | None = None
        if first_link_within is not None:
            self._connect_timer = awake_clock().call_later(first_link_within, self._first_link_overdue)
        self._drop_log = Throttle(log, "dropped a reply that cannot be decoded", LOG_EVERY_S)

    @property
    def closed(self) -> bool:
        return self._closed_error is not None

    def __len__(self) -> int:
        return len(self._pending)

    def call(
        self,
        method: str,
        args: Args,
        kwargs: dict[str, Any],
        *,
        target: str | None = None,
    ) -> asyncio.Future[Any]:
        """Send a call now; the future resolves with its result. Cancelling it cancels the remote call.

        ``args`` may be :class:`wire.EncodedArgs` (arguments encoded once for several calls; they
        hold the keyword arguments too, and ``kwargs`` is ignored).
        """
        fut: asyncio.Future[Any] = self._loop.create_future()
        if self._closed_error is not None or self._unreachable is not None:
            fut.set_exception(self._closed_error or self._unreachable)  # type: ignore[arg-type]
            return fut
        call_id = next(self._ids)
        env = _call_envelope(call_id, target, method, args, kwargs, 0)
        try:
            check_size(env, f"the call of {method!r} on {self.name}")
        except MessageTooLargeError as e:
            fut.set_exception(e)
            return fut
        self._pending[call_id] = fut
        self._sent[call_id] = (method, target, time.monotonic(), CURRENT_CALL.get())
        fut.add_done_callback(functools.partial(self._on_future_done, call_id))
        self._put(env)
        return fut

    def tell(
        self,
        method: str,
        args: Args,
        kwargs: dict[str, Any],
        *,
        target: str | None = None,
    ) -> None:
        """Send a call whose result nobody waits for (``args`` as in :meth:`call`)."""
        if self._closed_error is not None or self._unreachable is not None:
            raise self._closed_error or self._unreachable  # type: ignore[misc]
        env = _call_envelope(next(self._ids), target, method, args, kwargs, Flags.NO_REPLY)
        check_size(env, f"the call of {method!r} on {self.name}")
        self._put(env)

    def stream(
        self,
        method: str,
        args: tuple[Any, ...] | list[Any],
        kwargs: dict[str, Any],
        *,
        target: str | None = None,
    ) -> StreamCall:
        call_id = next(self._ids)
        s = StreamCall(self, call_id)
        if self._closed_error is not None or self._unreachable is not None:
            s._finish(self._closed_error or self._unreachable)
            return s
        env = wire.encode_envelope(Kind.CALL, call_id, target, method, list(args), kwargs, Flags.STREAM)
        try:
            check_size(env, f"the call of {method!r} on {self.name}")
        except MessageTooLargeError as e:
            s._finish(e)
            return s
        self._pending[call_id] = s
        self._sent[call_id] = (method, target, time.monotonic(), CURRENT_CALL.get())
        self._put(env)
        return s

    def pending_calls(self) -> list[dict[str, Any]]:
        """The calls waiting for a reply here: call id, method, target, age and the incoming method
        they were made from (for forensics)."""
        now = time.monotonic()
        return [
            {"call_id": cid, "method": m, "target": t, "age_s": round(now - t0, 3), "from": origin}
            for cid, (m, t, t0, origin) in list(self._sent.items())
            if cid in self._pending
        ]

    def _put(self, env: list[Any]) -> None:
        if self._waiting or len(self._pending) > MAX_IN_FLIGHT:
            self._waiting.append(env)
        else:
            self._outbox.put(env)

    def _release_waiting(self) -> None:
        while self._waiting and len(self._pending) <= MAX_IN_FLIGHT:
            self._outbox.put(self._waiting.popleft())

    def _on_future_done(self, call_id: int, fut: asyncio.Future[Any]) -> None:
        self._sent.pop(call_id, None)
        if fut.cancelled() and self._pending.pop(call_id, None) is not None:
            self._cancel(call_id)

    def _cancel(self, call_id: int) -> None:
        self._pending.pop(call_id, None)
        self._sent.pop(call_id, None)
        if self._closed_error is None:
            self._put(wire.encode_envelope(Kind.CANCEL, call_id))

    def _on_message(self, frames: list[Any]) -> None:
        try:
            envelopes = wire.split_batch(frames)
        except wire.WireError as e:
            self._drop_log(peer=self.name, reason=str(e))
            return
        for env in envelopes:
            try:
                msg = wire.decode_envelope(env)
            except wire.WireError as e:
                self._undecodable(env, e)
                continue
            kind, call_id = msg[0], msg[1]
            if kind == Kind.RESULT:
                fut = self._pending.pop(call_id, None)
                if isinstance(fut, StreamCall):  # a plain result answered a stream: fail it rather than hang
                    fut._finish(TypeError("the remote method is not a generator: await it, not `async for`"))
                elif fut is not None and not fut.done():
                    fut.set_result(msg[2])
            elif kind == Kind.ERROR:
                pending = self._pending.pop(call_id, None)
                if pending is not None:
                    exc = exception_from_payload(msg[2])
                    if isinstance(pending, StreamCall):
                        pending._finish(exc)
                    elif not pending.done():
                        pending.set_exception(exc)
            elif kind in (Kind.STREAM_ITEM, Kind.STREAM_END):
                s = self._pending.get(call_id)
                if isinstance(s, StreamCall):
                    if kind == Kind.STREAM_ITEM:
                        s._push(msg[2])
                    else:
                        self._pending.pop(call_id, None)
                        s._finish()
                elif s is not None:  # a stream answered a plain call: fail it rather than wait forever
                    self._pending.pop(call_id, None)
                    self._cancel(call_id)
                    if not s.done():
                        s.set_exception(
                            TypeError("the remote method is a generator: iterate it with `async for`")
                        )
            elif kind == Kind.PONG:
                fut = self._pending.pop(call_id, None)
                if isinstance(fut, asyncio.Future) and not fut.done():
                    fut.set_result(None)
        if self._waiting:
            self._release_waiting()

    def _on_too_large(self, frames: list[Any], why: str) -> None:
        """A reply over our max_message_bytes (the sender's bound is larger): fail its calls."""
        with contextlib.suppress(wire.WireError):
            for env in wire.split_batch(frames):
                header = wire.peek_header(env)
                if header is not None:
                    self._fail(
                        [header[1]], MessageTooLargeError(f"the reply from {self.name} was refused: {why}")
                    )

    def _undecodable(self, env: Any, err: Exception) -> None:
        """A reply we cannot decode (e.g. an unknown dataclass): fail that call, keep serving."""
        self._drop_log(peer=self.name, reason=str(err))
        header = wire.peek_header(env)
        if header is None:
            return
        pending = self._pending.pop(header[1], None)
        if isinstance(pending, StreamCall):
            pending._finish(err)
        elif pending is not None and not pending.done():
            pending.set_exception(err)

    def ping(self) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        call_id = next(self._ids)
        self._pending[call_id] = fut
        self._put(wire.encode_envelope(Kind.PING, call_id))
        return fut

    def fail_all(self, exc: BaseException) -> None:
        """Fail every pending call (the peer is gone)."""
        self._waiting.clear()
        self._fail(list(self._pending), exc)

    def _fail(self, call_ids: list[int], exc: BaseException) -> None:
        for call_id in call_ids:
            p = self._pending.pop(call_id, None)
            if isinstance(p, StreamCall):
                p._finish(exc)
            elif p is not None and not p.done():
                p.set_exception(exc)

    # --- liveness -------------------------------------------------------------------------------

    def _on_link(self, up: bool) -> None:
        """The connection came up (handshake done) or was lost (peer gone, or silent past the
        silence timeout and cut by the transport, as in a network partition)."""
        if self._link_hook is not None:
            self._link_hook(up)
        if up:
            self._link_down, self._unreachable = False, None
            self._link_up.set()
            if self._connect_timer is not None:
                self._connect_timer.cancel()
                self._connect_timer = None
            return
        self._link_up.clear()
        # The peer knows a reconnected socket by a new identity: replies to calls sent before
        # now never come. Fail them soon, leaving the head room to say first that the actor died.
        self._link_down = True
        self._at_risk.update(self._pending)
        if self._link_timer is None and self._closed_error is None:
            self._link_timer = awake_clock().call_later(LINK_GRACE_S, self._link_lost)

    def _first_link_overdue(self) -> None:
        """Never connected (a partition, or a stopped process): fail as a lost connection does."""
        self._connect_timer = None
        if self._closed_error is None and not self._link_up.is_set():
            self._link_down = True
            self._link_lost(never=True)

    def _link_lost(self, never: bool = False) -> None:
        self._link_timer = None
        if self._closed_error is not None:
            return
        what = (
            f"could not connect to {self.name}"
            if never
            else f"lost the connection to {self.name} (silent for {HEARTBEAT_TIMEOUT_MS / 1000:g}s, or gone) "
            f"and it was not back {LINK_GRACE_S:g}s later"
        )
        err = ActorUnreachableError(
            f"{what}: a network partition, or a stopped process? The call failed; it may or may not have run there"
        )
        lost = list(self._pending) if self._link_down else [i for i in self._at_risk if i in self._pending]
        self._at_risk.clear()
        if self._link_down:  # still unreachable: later calls fail at once until it is back
            self._unreachable = err
            self._waiting.clear()
        if lost:
            log.warning("calls failed: the peer stopped answering", peer=self.name, calls=len(lost))
        self._fail(lost, err)

    @property
    def linked(self) -> bool:
        """The connection is established now (its handshake done, its pings answered)."""
        return self._link_up.is_set() and self._closed_error is None

    async def wait_link(self) -> None:
        """Return once the connection is established (again), or closed."""
        await self._link_up.wait()

    async def drain(self) -> None:
        """Return once what this connection has to send is below its bound (``send_backlog_bytes``
        in its backlog, past ZeroMQ's queue), as asyncio's ``StreamWriter.drain()`` after
        ``write()``: a call or tell never waits, and a sender that does not await its results
        awaits this to be held back while the peer does not read. At once when nothing waits or
        the connection is closed (its calls have failed)."""
        await asyncio.sleep(0)  # this turn's envelopes reach the socket (the outbox flushes first)
        await self._asock.room()

    def close(self, exc: BaseException | None = None) -> None:
        for timer in (self._link_timer, self._connect_timer):
            if timer is not None:
                timer.cancel()
        self._link_timer = self._connect_timer = None
        if self._closed_error is None:
            self._closed_error = exc or RuntimeShutdownError(f"connection to {self.name} closed")
        self.fail_all(self._closed_error)
        self._link_up.set()  # wake wait_link(): nothing comes back on a closed connection
        self._outbox.flush()
        self._asock.close()


class ActorState:
    """The client's view of one actor: where it is and whether it is alive."""

    __slots__ = ("actor_id", "address", "alive", "changed", "name", "reason", "state")

    def __init__(self, actor_id: str, address: str, state: str) -> None:
        self.actor_id = actor_id
        self.address = address
        self.state = state
        self.reason = ""
        self.name: str | None = None
        self.alive = asyncio.Event()
        if state == "ALIVE":
            self.alive.set()
        self.changed = asyncio.Event()

    def died_error(self) -> ActorDiedError:
        who = f"{self.name} ({self.actor_id})" if self.name else self.actor_id
        return ActorDiedError(f"actor {who} died: {self.reason or 'process exited'}", self.actor_id)
