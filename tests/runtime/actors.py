"""Actor classes used by the runtime tests (importable by module path in workers)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np

import rlactors


class Counter(rlactors.Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start
        self.log: list[int] = []

    async def add(self, k: int) -> int:
        self.n += k
        return self.n

    async def record(self, i: int) -> None:
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
        await asyncio.wait_for(self.started.wait(), 10)
        return True

    async def was_cancelled(self) -> bool:
        await asyncio.wait_for(self.cancelled.wait(), 10)
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
