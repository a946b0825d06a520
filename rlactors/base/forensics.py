"""What a process can say about itself when a run hangs: stacks, the loop's lag, a dump by signal.

A worker answers ``stacks()`` from its event loop (see :meth:`rlactors.wire.service.Service.stacks`)
with the await chain of each call it runs, the stack of the thread running its sync method and
of every other thread, and how late its loop has been. A loop that cannot answer (a CPU-bound
coroutine, a blocking call) still dumps its Python stacks: every worker registers
:mod:`faulthandler` on :data:`DUMP_SIGNAL`, writing to a file its node agent reads after sending
the signal (:func:`collect_dump`). The loop's probe also stamps a tick file, so the agent can
say for how long the loop has been stuck.

A wait that is no actor call (a rollout client holding its requests while the trainer pushes
weights) is noted by the code that waits, with :func:`waiting`; ``stacks()`` lists it
(:func:`noted_waits`), labelled back-pressure by design when it is.

The cluster-wide report built from these answers is :mod:`rlactors.api.stacks`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import faulthandler
import itertools
import os
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import CoroutineType, FrameType
from typing import Any, BinaryIO

__all__ = [
    "CURRENT_CALL",
    "DUMP_SIGNAL",
    "LoopProbe",
    "collect_dump",
    "coroutine_stack",
    "noted_waits",
    "read_tick",
    "register_dump",
    "thread_stacks",
    "waiting",
]

DUMP_SIGNAL = signal.SIGUSR2
PROBE_EVERY_S = 0.25  # how often the loop probe wakes: its lag resolution, and the tick's
MAX_FRAMES = 64

# The incoming method the current task (or sync call) serves: outgoing calls made there are
# attributed to it, so a wait-for edge reads "a.f waits on b.g".
CURRENT_CALL: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlactors_call", default=None)

# The waits this process's code noted (waiting()): token -> (what, on, backpressure, origin, since)
_WAITS: dict[int, tuple[str, str, str, str | None, float]] = {}
_WAIT_TOKENS = itertools.count()


@contextlib.contextmanager
def waiting(what: str, on: str, backpressure: str = "") -> Iterator[None]:
    """Note, while the block runs, a wait that is no actor call, so ``cluster.stacks()`` lists it:
    ``what`` waits (``"dispatch paused"``) on ``on`` (``"the weight push"``, a server's URL: no
    actor). ``backpressure``: why the wait is by design, if it is; such a wait is labelled so and
    never names a culprit. Cheap (a dict entry): fine around every wait of its kind."""
    token = next(_WAIT_TOKENS)
    _WAITS[token] = (what, on, backpressure, CURRENT_CALL.get(), time.monotonic())
    try:
        yield
    finally:
        del _WAITS[token]


def noted_waits() -> list[dict[str, Any]]:
    """This process's waits noted by :func:`waiting`, alike ones together (what, on, the call they
    are made from): how many, and the oldest's age, oldest first."""
    now = time.monotonic()
    groups: dict[tuple[str, str, str, str | None], list[float]] = {}
    for what, on, bp, origin, since in list(_WAITS.values()):
        groups.setdefault((what, on, bp, origin), []).append(since)
    out = [
        {
            "what": what,
            "on": on,
            "backpressure": bp,
            "from": origin,
            "count": len(s),
            "age_s": round(now - min(s), 3),
        }
        for (what, on, bp, origin), s in groups.items()
    ]
    return sorted(out, key=lambda w: -w["age_s"])


def _format(frames: list[FrameType]) -> list[str]:
    """Frames, outermost first, as traceback lines ('File …, line …, in f' and the source line)."""
    summary = traceback.StackSummary.extract(
        ((f, f.f_lineno) for f in frames[-MAX_FRAMES:]), lookup_lines=True
    )
    return [line for chunk in summary.format() for line in chunk.rstrip("\n").split("\n")]


def coroutine_stack(coro: Any) -> list[str]:
    """A suspended coroutine's await chain, outermost first, down to the innermost frame and what
    it awaits (a future, a sleep). ``cr_await`` links coroutines; generators and async generators
    link by ``gi_yieldfrom`` and ``ag_await``."""
    frames: list[FrameType] = []
    awaited: Any = None
    seen = 0
    while coro is not None and seen < MAX_FRAMES:
        seen += 1
        frame = (
            getattr(coro, "cr_frame", None)
            or getattr(coro, "gi_frame", None)
            or getattr(coro, "ag_frame", None)
        )
        if frame is None:
            awaited = coro if not isinstance(coro, CoroutineType) else None
            break
        frames.append(frame)
        nxt = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "gi_yieldfrom", None)
            or getattr(coro, "ag_await", None)
        )
        if nxt is None:
            break
        coro = nxt
    if frames and frames[0].f_code.co_name == "_run_async":  # the service's wrapper, not the method
        frames = frames[1:]
    lines = _format(frames)
    if awaited is not None:
        lines.append(f"  awaiting {_awaited(awaited)}")
    return lines


def _awaited(obj: Any) -> str:
    if type(obj).__name__ == "FutureIter":  # `await future` in C: the future itself is not exposed
        return "a future (a reply, an event, a lock...)"
    text = repr(obj)
    return text if len(text) <= 200 else text[:197] + "..."


def thread_stacks() -> list[dict[str, Any]]:
    """Every Python thread of this process but the calling one (the loop's, answering this; its
    calls' await chains say more): its name, id and stack (outermost first)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        frames: list[FrameType] = []
        f: FrameType | None = frame
        while f is not None:
            frames.append(f)
            f = f.f_back
        frames.reverse()
        out.append({"name": names.get(ident, f"thread {ident}"), "ident": ident, "stack": _format(frames)})
    return out


# --- a blocked loop ------------------------------------------------------------------------------


class LoopProbe:
    """Measures how late the event loop wakes (its lag), and stamps a tick file on every wake so a
    process outside can tell how long the loop has been stuck."""

    def __init__(self, tick_file: Path | None = None) -> None:
        self.lag_s = 0.0  # the last wake's
        self.max_lag_s = 0.0  # the largest since the last report
        self._fd: int | None = None
        if tick_file is not None:
            self._fd = os.open(tick_file, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="rlactors-loop-probe")

    async def _run(self) -> None:
        while True:
            self._tick()
            t = time.monotonic()
            await asyncio.sleep(PROBE_EVERY_S)
            self.lag_s = max(0.0, time.monotonic() - t - PROBE_EVERY_S)
            self.max_lag_s = max(self.max_lag_s, self.lag_s)

    def _tick(self) -> None:
        if self._fd is not None:
            # the loop's thread too: a dump by signal names threads by ident, and the one that
            # takes the signal need not be the loop's
            with contextlib.suppress(OSError):
                os.pwrite(self._fd, struct.pack("<dQ", time.monotonic(), threading.get_ident()), 0)

    def report(self) -> dict[str, float]:
        """The loop's lag now and the most since the last report, in seconds."""
        out = {"lag_s": round(self.lag_s, 4), "max_lag_s": round(self.max_lag_s, 4)}
        self.max_lag_s = self.lag_s
        return out

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_tick(tick_file: Path) -> tuple[float | None, int | None]:
    """When the loop behind ``tick_file`` last woke (time.monotonic(), shared by a host's
    processes), and its thread's ident; None for what the file does not hold."""
    try:
        with open(tick_file, "rb") as f:
            data = f.read(16)
    except OSError:
        return None, None
    if len(data) == 16:
        tick, ident = struct.unpack("<dQ", data)
        return tick, ident
    return (struct.unpack("<d", data[:8])[0] if len(data) >= 8 else None), None


def register_dump(dump_file: Path) -> BinaryIO:
    """Dump every thread's Python stack to ``dump_file`` (appended) on :data:`DUMP_SIGNAL`.

    faulthandler writes from its C signal handler, so the dump comes even while the loop is stuck
    in a CPU-bound coroutine or a blocking call. The returned file must stay open.
    """
    f = open(dump_file, "ab", buffering=0)  # held open for the process's life
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    return f


async def collect_dump(pid: int, dump_file: Path, timeout_s: float) -> str | None:
    """Signal ``pid`` to dump its stacks into ``dump_file`` and return the new dump (None: none came
    within ``timeout_s``, e.g. a stopped process)."""
    try:
        start = os.stat(dump_file).st_size
    except OSError:
        return None
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return None
    deadline = time.monotonic() + timeout_s
    size = start
    # No event tells a file has grown: poll it. The dump is written at once, in one go.
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        with contextlib.suppress(OSError):
            now = os.stat(dump_file).st_size
            if now > start and now == size:  # grown, and done growing
                break
            size = now
    if size <= start:
        return None
    with open(dump_file, "rb") as f:  # noqa: ASYNC230 (a small local file)
        f.seek(start)
        return f.read().decode(errors="replace")
