"""Awake time: this process's monotonic clock less the time it was itself stalled.

Every place that declares a peer dead from silence (the head's node table and client sessions,
a node agent's fence on its workers, a client's lost-link timers) measures that silence here.
A judge that was stopped (SIGSTOP, a debugger breakpoint, a suspended laptop) or blocked (a long
synchronous call or GC pause on its loop) heard nothing in that time because it was not
listening; counting it would kill healthy peers. So a peer is judged silent only over time the
judge was awake: a stall pushes every deadline back by its length.

Stalls are measured by a tick on the event loop that notes how late it fires.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["TICK_S", "AwakeClock", "AwakeTimer", "awake_clock"]

TICK_S = 0.2  # how often the loop checks on itself
# Lateness of a tick up to this much is the loop being busy, not stalled (not counted).
SLACK_S = 0.3


class AwakeClock:
    """A monotonic clock that stands still while its event loop is stalled.

    ``now()`` is ``time.monotonic()`` minus every stall measured so far, and minus the current
    one while it lasts (a tick overdue by more than ``SLACK_S``), so a judge that runs before the
    tick after a stall already sees the stall. Use :func:`awake_clock` for the running loop's.
    """

    def __init__(self) -> None:
        self.stalled_s = 0.0  # total measured so far
        self._last_tick = time.monotonic()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._last_tick = time.monotonic()
        # The clock keeps no reference to the loop: a closed loop, with its ticks, is freed.
        loop.call_later(TICK_S, self._tick, context=contextvars.Context())

    def _overdue(self, now: float) -> float:
        late = now - self._last_tick - TICK_S
        return late if late > SLACK_S else 0.0

    def now(self) -> float:
        """Seconds of awake time (comparable only with this clock's other readings)."""
        t = time.monotonic()
        return t - self.stalled_s - self._overdue(t)

    def _tick(self) -> None:
        t = time.monotonic()
        self.stalled_s += self._overdue(t)
        self._last_tick = t
        asyncio.get_running_loop().call_later(TICK_S, self._tick, context=contextvars.Context())

    def call_later(
        self,
        delay: float,
        callback: Callable[..., Any],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> AwakeTimer:
        """Call ``callback(*args)`` once ``delay`` seconds of awake time have passed."""
        return AwakeTimer(self, self.now() + delay, callback, args, context)


class AwakeTimer:
    """A timer due at an awake time; fires late by any stall in between. ``cancel()`` stops it."""

    def __init__(
        self,
        clock: AwakeClock,
        due: float,
        callback: Callable[..., Any],
        args: tuple[Any, ...],
        context: contextvars.Context | None,
    ) -> None:
        self._clock, self._due, self._callback, self._args = clock, due, callback, args
        self._context = context or contextvars.copy_context()
        self._handle: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        left = max(0.0, self._due - self._clock.now())
        self._handle = asyncio.get_running_loop().call_later(left, self._fire, context=self._context)

    def _fire(self) -> None:
        if self._due - self._clock.now() > 0:  # a stall came between: the deadline moved back
            self._arm()
            return
        self._handle = None
        self._callback(*self._args)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


_clocks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AwakeClock] = weakref.WeakKeyDictionary()


def awake_clock() -> AwakeClock:
    """The running loop's awake clock, ticking from its first use."""
    loop = asyncio.get_running_loop()
    clock = _clocks.get(loop)
    if clock is None:
        clock = _clocks[loop] = AwakeClock()
        clock.start(loop)
    return clock
