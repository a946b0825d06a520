"""The process's runtime client: connections to actors, the head, and actor-state events."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from rlactors.base.aio import wait_for
from rlactors.base.awake import awake_clock
from rlactors.base.errors import (
    ActorDiedError,
    ActorNotFoundError,
    ClusterError,
    RuntimeShutdownError,
)
from rlactors.base.logging import Throttle
from rlactors.wire.beats import HeadBeats
from rlactors.wire.client import LINK_GRACE_S, ActorState, Args, Connection, StreamCall
from rlactors.wire.security import Security
from rlactors.wire.transport import HEARTBEAT_TIMEOUT_MS

log = structlog.get_logger("rlactors.wire.runtime")

_current: RuntimeClient | None = None
MAX_DEAD_ACTORS = 10_000  # dead actors remembered, so calls through old handles fail fast


def current_client() -> RuntimeClient:
    """The runtime client of this process (set by ``init``/``connect`` or in a worker)."""
    if _current is None or _current.closed:
        raise ClusterError(
            "not connected to a cluster: use `async with rlactors.init()` or `await rlactors.connect(address)`"
        )
    return _current


def _about(run: str) -> dict[str, Any]:
    """Who a client is, for the head to name its run: pid, host, command line and run."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "cmd": " ".join(sys.argv)[:200], "run": run}


def set_current(client: RuntimeClient | None) -> None:
    global _current
    _current = client


class RuntimeClient:
    """Connections of one process to a cluster, kept consistent with the head's actor events."""

    def __init__(
        self,
        head_address: str,
        security: Security | None = None,
        *,
        name: str = "driver",
        run: str | None = None,
    ) -> None:
        self.head_address = head_address
        self.security = security
        self.client_id = f"{name}-{uuid.uuid4().hex[:8]}"
        # The run this process belongs to: a driver's is its own client id; a worker's is its actor's
        # run. The actors of a run are stopped when its driver leaves or is given up (rlactors.head.head).
        # "" (a detached actor's worker): no run; what it spawns is its own, stopped when it goes.
        self.run = self.client_id if run is None else run
        self.leaving = False  # the head ends our event stream because we asked to leave
        self.closed = False
        self._conns: dict[str, Connection] = {}
        self._actors: dict[str, ActorState] = {}
        self._dead: collections.deque[str] = collections.deque()  # ids of dead actors, oldest first
        self._checks: set[asyncio.Task[None]] = set()
        # group calls still gathering (ActorGroup): a member whose call failed is still waited on
        # from the caller's side (its peers may be blocked in a collective on it), for forensics
        self._group_calls: set[GroupCall] = set()
        self._events_task: asyncio.Task[None] | None = None
        self._beat_task: asyncio.Task[None] | None = None  # refreshes what the beats carry
        self._beats: HeadBeats | None = None  # heartbeats to the head, from their own thread
        # what the beats carry, as this loop last noted it, and when (one tuple: read from the
        # beats' thread, it is never half updated)
        self._noted: tuple[dict[str, Any], float] = ({}, time.monotonic())
        self._events: StreamCall | None = None  # the current subscription to the head's events
        self._synced = asyncio.Event()
        self.head: Connection | None = None

    async def start(self, *, timeout: float = 30.0) -> None:
        """Connect to the head and follow its actor events (returns once the first snapshot is in)."""
        self.head = Connection(self.head_address, self.security, name="head")
        try:
            call = self.head.call("hello", (self.client_id, _about(self.run)), {}, target="head")
            hello = await wait_for(call, timeout)
        except TimeoutError:
            self.head.close()
            raise ClusterError(
                f"no head answered at {self.head_address} within {timeout:.0f}s: is the cluster up, "
                "and do you have its secret (RLACTORS_SECRET_FILE / the cluster's secret file)?"
            ) from None
        interval = float(hello.get("client_heartbeat", 2.0))
        self._note()
        self._beats = HeadBeats(
            self.head_address,
            self.security,
            self.client_id,
            interval,
            payload=self._beat_now,
            on_answer=self._beat_answered,
            on_head_lost=self._head_lost,
            loop=asyncio.get_running_loop(),
            clock=awake_clock(),
        )
        await asyncio.to_thread(self._beats.start)
        self._beat_task = asyncio.get_running_loop().create_task(
            self._note_beats(interval), name="rlactors-client-beat-payload"
        )
        self._events_task = asyncio.get_running_loop().create_task(
            self._follow_events(), name="rlactors-events"
        )
        try:
            await wait_for(self._synced.wait(), timeout)
        except TimeoutError:
            raise ClusterError(
                f"head at {self.head_address} did not send actor events within {timeout:.0f}s"
            ) from None

    async def leave(self, timeout: float = 10.0) -> None:
        """Tell the head this client leaves (it stops the actors of our run), then close."""
        self.leaving = True
        # best effort: the head may be gone; the client closes either way
        with contextlib.suppress(Exception):
            await wait_for(self.head_call("client_closed", self.client_id), timeout)
        await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._beat_task is not None:
            self._beat_task.cancel()
        if self._beats is not None:
            await asyncio.to_thread(self._beats.stop)
        for task in self._checks:
            task.cancel()
        if self._events_task is not None:
            self._events_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._events_task
        for conn in self._conns.values():
            conn.close(RuntimeShutdownError("cluster connection closed"))
        self._conns.clear()
        if self.head is not None:
            self.head.close()
        if _current is self:
            set_current(None)

    # --- head -----------------------------------------------------------------------------------

    def _note(self) -> None:
        """Note what a heartbeat carries: a driver's pending calls (the roots of the wait-for graph),
        so that ``cluster.stacks()`` asked from another process (``rlactors stack``) holds them too.
        A worker's are asked from its own loop."""
        calls = [] if "RLACTORS_ACTOR_ID" in os.environ else self.outgoing_calls()
        calls.sort(key=lambda c: -c["age_s"])
        self._noted = ({"calls": calls[:MAX_BEAT_CALLS]} if calls else {}, time.monotonic())

    def _beat_now(self) -> dict[str, Any]:
        """The last note, with its age (``noted_s``), for the beat the beats' thread sends now: a loop
        blocked since (synchronous code in the driver) has not noted again, and a call noted then
        may have been answered since."""
        payload, at = self._noted
        return dict(payload, noted_s=round(time.monotonic() - at, 3)) if payload else {}

    async def _note_beats(self, interval: float) -> None:
        """Keep what the next heartbeat carries current (rlactors.wire.beats sends it from its thread)."""
        while True:
            await asyncio.sleep(interval)
            self._note()

    def _beat_answered(self, known: Any) -> None:
        if known is False and self._events is not None:
            # We were silent past the head's client timeout (this process was stopped, or cut off):
            # it stopped our non-detached actors and ended our event stream (its end may be lost with
            # a dropped connection).
            log.warning(
                "the head had given this client up (silent past its client_timeout); following its events again",
                client=self.client_id,
            )
            self._events.cancel()

    def _head_lost(self) -> None:
        log.error("the head stopped answering; calls to it fail until it is back", head=self.head_address)
        if self.head is not None:
            self.head.fail_all(ClusterError(f"the head at {self.head_address} stopped answering"))

    def head_call(self, method: str, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        if self.head is None or self.head.closed:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(RuntimeShutdownError("not connected to the head"))
            return fut
        return self.head.call(method, args, kwargs, target="head")

    async def _follow_events(self) -> None:
        """Follow the head's actor events for as long as this client lives, subscribing again
        whenever a stream ends (the head ends it when it gives a silent client up)."""
        backoff = 0.1
        lost_stream = Throttle(log, "lost the head's event stream; subscribing again", 60.0)
        while not self.closed and self.head is not None and not self.head.closed:
            try:
                await self._follow_stream()
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as e:  # whatever broke the event stream, it is followed again after a backoff
                lost_stream(error=repr(e))
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 2.0)
            else:
                if self.leaving:
                    return
                if not self.closed:
                    log.warning("the head ended this client's event stream; subscribing again")

    async def _follow_stream(self) -> None:
        assert self.head is not None
        self._events = stream = self.head.stream("subscribe", (self.client_id,), {}, target="head")
        async for event in stream:
            if event.get("type") == "snapshot":
                self._apply_snapshot(event["actors"])
            elif event.get("type") == "actor":
                self._update(
                    event["actor_id"],
                    event["state"],
                    event["address"],
                    event.get("reason", ""),
                    event.get("name"),
                )

    def _apply_snapshot(self, actors: list[dict[str, Any]]) -> None:
        for a in actors:
            self._update(a["actor_id"], a["state"], a["address"], a.get("reason", ""), a.get("name"))
        # An actor the head does not list may have died and been forgotten while we were not
        # following (or be newer than this snapshot): ask about it.
        listed = {a["actor_id"] for a in actors}
        for actor_id, st in list(self._actors.items()):
            if actor_id not in listed and st.state != "DEAD":
                self._verify(st)
        self._synced.set()

    def _update(self, actor_id: str, state: str, address: str, reason: str, name: str | None = None) -> None:
        st = self._actors.get(actor_id)
        if st is None:
            st = self._actors[actor_id] = ActorState(actor_id, address, "PENDING")
        st.name = name or st.name
        old, old_state = st.address, st.state
        st.state, st.reason = state, reason
        if state == "DEAD" and old_state != "DEAD":
            self._forget_old_dead(actor_id)
        if state in ("DEAD", "RESTARTING"):
            st.alive.clear()
            conn = self._conns.pop(old, None)
            if conn is not None:
                conn.close(st.died_error())
        elif state == "ALIVE":
            st.address = address
            st.alive.set()
        changed, st.changed = st.changed, asyncio.Event()
        changed.set()

    # --- actors ---------------------------------------------------------------------------------

    def _actor_connection(self, st: ActorState) -> Connection:
        conn = self._conns.get(st.address)
        if conn is None or conn.closed:
            who = f"actor {st.name} ({st.actor_id})" if st.name else f"actor {st.actor_id}"
            # The actor was listening when the head made it ALIVE: a first connection that does
            # not come up (a partition, a stopped worker) fails its calls rather than leave them waiting.
            conn = self._conns[st.address] = Connection(
                st.address,
                self.security.calls if self.security is not None else None,  # control: head and agents only
                name=f"{who} at {st.address}",
                first_link_within=HEARTBEAT_TIMEOUT_MS / 1000 + LINK_GRACE_S,
            )
            conn.peer = (st.actor_id, st.name)
        return conn

    def outgoing_calls(self) -> list[dict[str, Any]]:
        """This process's calls to actors still waiting for a reply, each with the target actor's
        id and name (for ``cluster.stacks()``); and, of an ``ActorGroup`` call still gathering,
        each member whose call failed (``failed``: the error), which the call still waits on."""
        out: list[dict[str, Any]] = []
        for conn in list(self._conns.values()):
            if conn.peer is not None and len(conn):
                actor_id, name = conn.peer
                st = self._actors.get(actor_id)
                name = (st.name if st is not None else None) or name
                out.extend(dict(c, actor_id=actor_id, name=name) for c in conn.pending_calls())
        return out + self._failed_group_members()

    def group_call(self, call: GroupCall) -> contextlib.AbstractContextManager[None]:
        """Hold ``call`` in :meth:`outgoing_calls` while the ``with`` block runs."""
        return _held(self._group_calls, call)

    def _failed_group_members(self) -> list[dict[str, Any]]:
        out = []
        now = time.monotonic()
        for g in list(self._group_calls):
            for (actor_id, name), fut in zip(g.members, g.calls, strict=True):
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    e = fut.exception()
                    out.append(
                        {
                            "actor_id": actor_id,
                            "name": name,
                            "method": g.method,
                            "age_s": round(now - g.started, 3),
                            "call_id": 0,
                            "from": g.origin,
                            "failed": f"{type(e).__name__}: {e}",
                            "group": len(g.members),
                        }
                    )
        return out

    def _forget_old_dead(self, actor_id: str) -> None:
        self._dead.append(actor_id)
        while len(self._dead) > MAX_DEAD_ACTORS:
            old = self._actors.get(self._dead.popleft())
            if old is not None and old.state == "DEAD":
                del self._actors[old.actor_id]

    def actor_state(self, actor_id: str, address: str) -> ActorState:
        st = self._actors.get(actor_id)
        if st is None:
            st = self._actors[actor_id] = ActorState(actor_id, address, "ALIVE")
            if self._synced.is_set():
                # Every actor the head knows reached us with its events: ask about this stranger
                # (a handle to an actor long dead and forgotten) rather than let calls to it hang.
                self._verify(st)
        return st

    def _verify(self, st: ActorState) -> None:
        """Ask the head whether an actor it did not tell us about exists; mark it dead if not."""
        task = asyncio.get_running_loop().create_task(self._check_known(st))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check_known(self, st: ActorState) -> None:
        try:
            await wait_for(self.head_call("get_actor", st.actor_id), 30)
        except ActorNotFoundError:
            if st.state != "DEAD":
                reason = st.reason or "unknown to the head (it died long ago, or never existed)"
                self._update(st.actor_id, "DEAD", st.address, reason)
        except Exception:  # the head is unreachable: the heartbeat reports that
            pass

    def call_actor(
        self,
        actor_id: str,
        address: str,
        method: str,
        args: Args,
        kwargs: dict[str, Any],
        *,
        target: str | None = None,
    ) -> asyncio.Future[Any]:
        st = self.actor_state(actor_id, address)
        if st.state == "ALIVE":
            return self._actor_connection(st).call(method, args, kwargs, target=target)
        if st.state == "DEAD":
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(st.died_error())
            return fut
        return asyncio.ensure_future(self._call_when_alive(st, method, args, kwargs, target))

    async def _call_when_alive(
        self,
        st: ActorState,
        method: str,
        args: Args,
        kwargs: dict[str, Any],
        target: str | None = None,
    ) -> Any:
        await self.wait_alive(st)
        return await self._actor_connection(st).call(method, args, kwargs, target=target)

    async def wait_alive(self, st: ActorState, timeout: float = 300.0) -> None:
        """Wait while an actor restarts; raise ActorDiedError if it ends up dead."""
        async with asyncio.timeout(timeout):
            while st.state != "ALIVE":
                if st.state == "DEAD":
                    raise st.died_error()
                await st.changed.wait()

    async def wait_reachable(self, actor_id: str, timeout: float) -> None:
        """After an :class:`ActorUnreachableError`: wait until the actor's connection is back (it
        answers again), or its node agent has replaced it (it was hung; see ``fence_after``) and
        the new incarnation is alive.

        Raises ActorDiedError if it ends up dead, TimeoutError if neither happens in ``timeout``.
        """
        st = self._actors.get(actor_id)
        if st is None:
            return
        async with asyncio.timeout(timeout):
            while True:
                if st.state == "DEAD":
                    raise st.died_error()
                conn = self._conns.get(st.address) if st.state == "ALIVE" else None
                if st.state == "ALIVE" and (conn is None or conn.closed or conn.linked):
                    return
                waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(st.changed.wait())]
                if conn is not None:
                    waits.append(asyncio.ensure_future(conn.wait_link()))
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()

    async def drain_actor(self, actor_id: str, address: str) -> None:
        """Wait until the calls sent to this actor are below the backlog bound (Connection.drain)."""
        st = self.actor_state(actor_id, address)
        conn = self._conns.get(st.address) if st.state == "ALIVE" else None
        if conn is not None and not conn.closed:
            await conn.drain()

    def tell_actor(
        self, actor_id: str, address: str, method: str, args: Args, kwargs: dict[str, Any]
    ) -> None:
        st = self.actor_state(actor_id, address)
        if st.state == "DEAD":
            raise st.died_error()
        if st.state == "ALIVE":
            self._actor_connection(st).tell(method, args, kwargs)
        else:
            task = asyncio.ensure_future(self._call_when_alive(st, method, args, kwargs))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def stream_actor(
        self, actor_id: str, address: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> StreamCall:
        st = self.actor_state(actor_id, address)
        if st.state != "ALIVE":
            s = StreamCall(None, -1)
            s._finish(
                st.died_error()
                if st.state == "DEAD"
                else ActorDiedError(f"actor {actor_id} is restarting", actor_id)
            )
            return s
        return self._actor_connection(st).stream(method, args, kwargs)


MAX_BEAT_CALLS = 200  # a driver's pending calls a heartbeat carries, the oldest first


@dataclass(eq=False)
class GroupCall:
    """One call of an ``ActorGroup`` method: its members' ``(actor id, name)`` and their futures."""

    method: str
    members: list[tuple[str, str | None]]
    calls: list[asyncio.Future[Any]]
    origin: str | None = None  # the incoming method it was made from (in an actor)
    started: float = field(default_factory=time.monotonic)


@contextlib.contextmanager
def _held(calls: set[GroupCall], call: GroupCall) -> Iterator[None]:
    calls.add(call)
    try:
        yield
    finally:
        calls.discard(call)
