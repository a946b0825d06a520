"""asyncio helpers the runtime and the nodes share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``asyncio.wait_for`` that never loses a cancellation.

    On Python 3.11, ``asyncio.wait_for`` returns the result instead of raising
    ``CancelledError`` when the cancel lands in the same loop turn as the awaited thing
    completes (fixed in 3.12). A task cancelled that way carries on as if never asked to
    stop: a loop built on it never ends, and whoever waits for it (``asyncio.run``'s
    teardown, an actor's stop) hangs. ``asyncio.timeout`` has no such window.
    """
    async with asyncio.timeout(timeout):
        return await aw
