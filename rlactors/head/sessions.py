"""The head's view of its clients: who is still heartbeating, and the actor-state event stream
each one subscribed to (a bounded queue per subscriber; one that stops reading is cut off rather
than let the head's memory grow)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import structlog

from rlactors.base.awake import awake_clock

log = structlog.get_logger("rlactors.head.head")

MAX_QUEUED_EVENTS = 10_000  # events queued for one subscriber before it is deemed gone


class Sessions:
    """Client heartbeats and event subscriptions."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._seen: dict[str, float] = {}  # client id -> last heartbeat, in awake time
        # Clients in the head's own process (the embedded cluster's driver): late beats mean this
        # process is short of CPU, not a client gone, so no deadline.
        self.in_process: set[str] = set()
        self._subs: dict[asyncio.Queue[dict[str, Any] | None], str] = {}  # event queue -> client id

    def beat(self, client_id: str) -> bool:
        """The client said hello or heartbeat; False if it was not (or no longer) known."""
        known = client_id in self._seen
        self._seen[client_id] = awake_clock().now()
        return known

    def close(self, client_id: str) -> None:
        """The client left: forget it and end its event streams."""
        self._seen.pop(client_id, None)
        self.in_process.discard(client_id)
        self._end(client_id)

    def expire(self) -> list[str]:
        """Close and return the clients silent for longer than the timeout while the head was awake."""
        now = awake_clock().now()
        gone = [
            cid
            for cid, seen in self._seen.items()
            if cid not in self.in_process and now - seen > self.timeout
        ]
        for cid in gone:
            self.close(cid)
        return gone

    async def subscribe(self, client_id: str, snapshot: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """``snapshot`` first, then every published event, until the client is closed."""
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._subs[q] = client_id
        try:
            yield snapshot
            while (event := await q.get()) is not None:
                yield event
        finally:
            self._subs.pop(q, None)

    def publish(self, event: dict[str, Any]) -> None:
        """Queue ``event`` for every subscriber."""
        for q, cid in list(self._subs.items()):
            if q.qsize() > MAX_QUEUED_EVENTS:  # a subscriber that stopped reading: end its stream
                log.warning("dropping an event subscriber that stopped reading", client=cid)
                del self._subs[q]
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(None)
            else:
                q.put_nowait(event)

    def _end(self, client_id: str) -> None:
        for q, cid in list(self._subs.items()):
            if cid == client_id:
                del self._subs[q]
                q.put_nowait(None)
