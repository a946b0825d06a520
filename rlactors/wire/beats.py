"""A client's heartbeats to the head, sent from a thread of their own.

The head gives a client up when it falls silent for ``client_timeout`` seconds, and stops the
actors of its run. Silence must mean the process is gone or stopped, not that its event loop is
busy: a driver that tokenizes a dataset, builds a large batch or runs a user's synchronous code for
longer than that is alive, and its run must not be stopped under it. So the beats go out from a
daemon thread with its own event loop and its own connection to the head; they stop only with the
process (killed, or stopped as a whole by SIGSTOP or a debugger).

A beat carries what the client's loop last noted (a driver's pending calls, for ``rlactors
stack``): the loop refreshes that snapshot at each beat's interval, and a blocked loop leaves the
last one in place, which is still true while it is blocked. What the head answers is handed back to
the client's loop. A beat that goes unanswered counts as a miss only if the client's loop was awake
for the whole wait (its :mod:`rlactors.base.awake` clock moved): a head in this very process (the
embedded cluster) cannot answer while the loop it shares is blocked, and that is not the head
being gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import structlog

from rlactors.base.aio import wait_for
from rlactors.base.awake import AwakeClock
from rlactors.base.errors import ActorUnreachableError
from rlactors.wire.client import Connection
from rlactors.wire.security import Security

__all__ = ["HeadBeats"]

log = structlog.get_logger("rlactors.wire.runtime")

MISSES = 3  # beats in a row without an answer before the head counts as gone


class HeadBeats:
    """Send ``client_alive(client_id, payload())`` to the head every ``interval`` seconds from a
    daemon thread. ``on_answer(known)`` and ``on_head_lost()`` are called on ``loop`` (the client's).
    ``clock`` is the client loop's awake clock."""

    def __init__(
        self,
        address: str,
        security: Security | None,
        client_id: str,
        interval: float,
        *,
        payload: Callable[[], dict[str, Any]],
        on_answer: Callable[[Any], None],
        on_head_lost: Callable[[], None],
        loop: asyncio.AbstractEventLoop,
        clock: AwakeClock,
    ) -> None:
        self.address, self.security, self.client_id, self.interval = address, security, client_id, interval
        self._payload, self._on_answer, self._on_head_lost = payload, on_answer, on_head_lost
        self._client_loop, self._client_clock = loop, clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._failed: BaseException | None = None  # why the thread could not start beating
        self._thread = threading.Thread(target=self._run, name=f"rlactors-beats-{client_id}", daemon=True)

    def start(self) -> None:
        """Start beating; raises what kept the thread from connecting to the head."""
        self._thread.start()
        self._started.wait()
        if self._failed is not None:
            raise self._failed

    def stop(self, timeout: float = 5.0) -> None:
        """Stop beating and close the thread's connection (blocks up to ``timeout`` s)."""
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # its loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._beat())
        except BaseException as e:  # whatever ended the thread before start() returned is start()'s to raise
            if self._started.is_set():
                raise
            self._failed = e  # start() raises it in the client's thread
        finally:
            self._started.set()  # a failure to start must not leave start() waiting

    def _to_client(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the client's loop is closed: it is going away
            self._client_loop.call_soon_threadsafe(fn, *args)

    async def _beat(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        conn = Connection(self.address, self.security, name="head (heartbeats)")
        self._started.set()
        missed = 0
        try:
            while not self._stop.is_set():
                sent = self._client_clock.now()
                try:
                    call = conn.call("client_alive", (self.client_id,), self._payload(), target="head")
                    known = await wait_for(call, 5 * self.interval)
                    missed = 0
                    self._to_client(self._on_answer, known)
                except (TimeoutError, ActorUnreachableError) as e:
                    # a wait the client's loop slept through (blocked or stopped) is no miss
                    awake = self._client_clock.now() - sent >= 5 * self.interval
                    missed += isinstance(e, ActorUnreachableError) or awake
                    if missed == MISSES:
                        self._to_client(self._on_head_lost)
                except Exception as e:  # logged and retried; losing the head is counted above
                    log.warning("heartbeat to the head failed", error=repr(e))
                with contextlib.suppress(TimeoutError):
                    await wait_for(self._stop.wait(), self.interval)
        finally:
            conn.close()
