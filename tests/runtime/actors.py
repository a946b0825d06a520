"""Actor classes used by the runtime tests (importable by module path in workers)."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time

import numpy as np

import rlactors
from protocols.runtime import codec
from rlactors.base.aio import wait_for


class Heap(rlactors.Actor):
    """Holds what its start built, and what a call built after."""

    def __init__(self) -> None:
        self.built: list[object] = [{}]
        self.later: list[object] = []

    async def on_start(self) -> None:
        self.started: list[object] = [{}]

    async def walked(self) -> dict[str, bool]:
        """Which of its objects a full collection walks (a frozen object is in no generation)."""
        self.later = [{}]
        seen = {id(o) for o in gc.get_objects()}
        return {k: id(getattr(self, k)) in seen for k in ("built", "started", "later")}


class Counter(rlactors.Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start
        self.log: list[int] = []

    async def add(self, k: int) -> int:
        self.n += k
        return self.n

    async def record(self, i: int) -> None:
        self.log.append(i)

    async def take(self, i: int, payload: object) -> None:
        self.log.append(i)

    async def get_log(self) -> list[int]:
        return self.log

    async def value(self) -> int:
        return self.n

    async def pid(self) -> int:
        return os.getpid()

    async def fail(self, msg: str) -> None:
        raise ValueError(msg)

    async def sleep(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "slept"

    async def echo(self, x: object) -> object:
        return x

    async def count_to(self, n: int):
        for i in range(n):
            yield i

    async def stream_then_fail(self, n: int):
        for i in range(n):
            yield i
        raise RuntimeError("stream broke")

    def sync_threads(self) -> str:
        return threading.current_thread().name


class Cancellable(rlactors.Actor):
    """Records whether a running coroutine saw its cancellation."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def wait_forever(self) -> None:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def wait_started(self) -> bool:
        await wait_for(self.started.wait(), 10)
        return True

    async def was_cancelled(self) -> bool:
        await wait_for(self.cancelled.wait(), 10)
        return True


class Compute(rlactors.Actor):
    """A sync method that blocks its thread; async methods must still be served."""

    def __init__(self) -> None:
        self.order: list[int] = []

    def busy(self, seconds: float) -> str:
        time.sleep(seconds)
        return threading.current_thread().name

    def append(self, i: int) -> None:
        self.order.append(i)

    def get_order(self) -> list[int]:
        return self.order

    async def ping(self) -> str:
        return "pong"

    def total(self, a: np.ndarray) -> float:
        return float(a.sum())


class Boom(rlactors.Actor):
    def __init__(self) -> None:
        raise RuntimeError("constructor exploded")


class Printer(rlactors.Actor):
    async def say(self, text: str) -> None:
        print(text, flush=True)


class Logger(rlactors.Actor):
    async def log_something(self) -> None:
        import structlog

        structlog.get_logger("test").info("inside a call")

    def log_sync(self) -> None:
        import structlog

        structlog.get_logger("test").info("inside a sync call")


class Tricky(rlactors.Actor):
    """Methods that used to hang their callers (code review findings)."""

    async def cancelled_inside(self) -> None:
        t = asyncio.ensure_future(asyncio.sleep(10))
        t.cancel()
        await t

    def sync_then_ok(self) -> str:
        return "ok"

    async def gen(self, n: int):
        for i in range(n):
            yield i

    async def ping(self) -> str:
        return "pong"

    def print_line(self, n: int) -> int:
        print("x" * n, flush=True)
        return n


class Counted:
    """A value that counts how often this process encodes it (a group call must encode once)."""

    encoded = 0

    def __init__(self, payload: np.ndarray) -> None:
        self.payload = payload


def _counted_to_wire(c: Counted) -> np.ndarray:
    Counted.encoded += 1
    return c.payload


codec.register_type(Counted, "tests.runtime.actors:Counted", _counted_to_wire, Counted)


class Member(Cancellable):
    """A group member whose part in a group call is chosen per rank by the call's ``plan``:
    ``plan[rank]`` is ``[what, delay_s]``, what one of "ok", "raise" (a transport-like error) or "die".
    ``wait_started``/``was_cancelled`` are Cancellable's."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.finished = 0

    async def act(self, plan: list[list]) -> int:
        what, delay = plan[self.rank]
        self.started.set()
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        if what == "die":
            os._exit(1)
        if what == "raise":
            raise ConnectionError(f"rank {self.rank}: connection to a peer lost")
        self.finished += 1
        return self.rank

    async def total(self, c: Counted) -> float:
        return float(c.payload.sum()) + self.rank

    async def finished_calls(self) -> int:
        return self.finished


class Ledger:
    """A plain object that lives on an event loop (it sets an asyncio.Event), as the nodes' cores do."""

    def __init__(self) -> None:
        self.items: list[int] = []
        self.changed = asyncio.Event()

    def add(self, x: int) -> str:
        self.items.append(x)
        self.changed.set()
        return threading.current_thread().name

    async def wait_len(self, n: int) -> list[int]:
        while len(self.items) < n:
            self.changed.clear()
            await wait_for(self.changed.wait(), 10)
        return self.items

    @rlactors.blocking
    def busy(self, seconds: float) -> str:
        time.sleep(seconds)
        return threading.current_thread().name


class LoopLedger(Ledger, rlactors.Actor, sync_methods="loop"):
    """The ledger served as it is: its sync methods run on the worker's loop."""


class Watcher(rlactors.Actor, sync_methods="loop"):
    """Watches other actors and records their deaths."""

    def __init__(self) -> None:
        self.deaths: list[str] = []
        self.changed = asyncio.Event()

    def watch(self, actor_id: str, label: str) -> int:
        ctx = rlactors.get_context()
        ctx.watch(actor_id, self._died, label)
        return len(ctx._watches)

    def _died(self, label: str) -> None:
        self.deaths.append(label)
        self.changed.set()

    async def wait_deaths(self, n: int) -> list[str]:
        while len(self.deaths) < n:
            self.changed.clear()
            await wait_for(self.changed.wait(), 10)
        return self.deaths
