"""What a process can say about itself when a run hangs: stacks, the loop's lag, a dump by signal.

A worker answers ``stacks()`` from its event loop (see :meth:`rlactors.wire.service.Service.stacks`)
with the await chain of each call it runs, the stack of the thread running its sync method and
of every other thread, and how late its loop has been. A loop that cannot answer (a CPU-bound
coroutine, a blocking call) still dumps its Python stacks on :data:`DUMP_SIGNAL`, into a file its
node agent reads after sending the signal (:func:`collect_dump`); one stuck in C code that never
returns to Python dumps by :mod:`faulthandler` on :data:`FALLBACK_DUMP_SIGNAL`, sent only when the
first brought nothing (:func:`register_dump` says why faulthandler is not the first). The loop's
probe also stamps a tick file, so the agent can say for how long the loop has been stuck.

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
import functools
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
    "FALLBACK_DUMP_SIGNAL",
    "LoopProbe",
    "collect_dump",
    "coroutine_stack",
    "noted_waits",
    "read_tick",
    "register_dump",
    "thread_stacks",
    "unregister_dump",
    "waiting",
]

DUMP_SIGNAL = signal.SIGUSR2  # a dump written by the main thread, holding the GIL (register_dump)
# faulthandler's dump of the thread it lands on, for a main thread that never returns to Python
# (register_dump). Ignored by default: a process that registered nothing is not killed by it.
FALLBACK_DUMP_SIGNAL = signal.SIGURG
MAX_DUMP_FRAMES = 100  # a thread's innermost frames a dump writes, as faulthandler
PROBE_EVERY_S = 0.25  # how often the loop probe wakes: its lag resolution, and the tick's
MAX_FRAMES = 64

# The incoming method the current task (or sync call) serves: outgoing calls made there are
# attributed to it, so a wait-for edge reads "a.f waits on b.g".
CURRENT_CALL: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlactors_call", default=None)

# sys._current_frames() holds the runtime's lock on its thread list while it allocates, and a
# collection there may run code, a dump signal's handler included: that handler calling it again
# would wait on that lock forever (https://github.com/python/cpython/issues/106883).
_reading_frames = False

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


def _current_frames() -> dict[int, FrameType] | None:
    """``sys._current_frames()``; None when a call of it is already under way (see _dump_stacks)."""
    global _reading_frames
    if _reading_frames:
        return None
    _reading_frames = True
    try:
        return sys._current_frames()
    finally:
        _reading_frames = False


def thread_stacks() -> list[dict[str, Any]]:
    """Every Python thread of this process but the calling one (the loop's, answering this; its
    calls' await chains say more): its name, id and stack (outermost first)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in (_current_frames() or {}).items():
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
    """Dump every thread's Python stack to ``dump_file`` (appended) on :data:`DUMP_SIGNAL`, and by
    :mod:`faulthandler` on :data:`FALLBACK_DUMP_SIGNAL`. Call it from the main thread; the returned
    file must stay open (:func:`unregister_dump` closes it).

    The first is a Python handler: the main thread (the loop's) runs it between two bytecodes, so
    also inside a CPU-bound coroutine or a blocking call the signal interrupts (a sleep, a lock, a
    socket), and it reads the other threads' frames holding the GIL, while they stand still.
    faulthandler's all-thread dump reads them from a C signal handler, without the GIL, while
    another thread runs and pops them: on CPython 3.11 that crashes the process it dumps (SIGSEGV;
    https://github.com/python/cpython/issues/116008). So faulthandler is left for a main thread
    stuck in C code, which no Python handler reaches, and dumps only the thread the signal lands on
    (the main one, which Linux prefers), reading no other. Both write faulthandler's format, read
    by ``rlactors.api.stacks.dump_loop_thread``.
    """
    f = open(dump_file, "ab", buffering=0)  # held open for the process's life
    fd = f.fileno()
    signal.signal(DUMP_SIGNAL, functools.partial(_on_dump_signal, fd))
    faulthandler.register(FALLBACK_DUMP_SIGNAL, file=f, all_threads=False, chain=False)
    return f


def unregister_dump(f: BinaryIO) -> None:
    """Undo :func:`register_dump`, closing its file ``f``."""
    signal.signal(DUMP_SIGNAL, signal.SIG_DFL)
    faulthandler.unregister(FALLBACK_DUMP_SIGNAL)
    f.close()


def _on_dump_signal(fd: int, signum: int, frame: FrameType | None) -> None:
    _dump_stacks(fd, frame)


def _own(frame: FrameType | None) -> FrameType | None:
    """``frame`` less the dump handler's own frames on top: a second signal that lands while the
    first one's dump is still being written interrupts the handler, not the program."""
    while frame is not None and frame.f_code in (_on_dump_signal.__code__, _dump_stacks.__code__):
        frame = frame.f_back
    return frame


def _dump_stacks(fd: int, interrupted: FrameType | None) -> None:
    """Write every thread's stack to ``fd`` in faulthandler's format; "Current thread" is this one,
    from the frame the signal interrupted. A signal handler, run between any two bytecodes of the
    main thread: it takes no lock (the code it interrupted may hold threading's) and raises nothing
    into that code."""
    try:
        interrupted = _own(interrupted)
        me = threading.get_ident()
        blocks = []
        read = _current_frames()
        frames: dict[int, FrameType | None] = {me: interrupted} if read is None else dict(read)
        if read is None:  # the signal came inside a read of them: this thread's stack only
            blocks.append("(the other threads not read: the signal came while they were being read)\n")
        for ident, frame in frames.items():
            f = interrupted if ident == me else frame
            head = "Current thread" if ident == me else "Thread"
            lines = [f"{head} 0x{ident:016x} (most recent call first):"]
            while f is not None and len(lines) <= MAX_DUMP_FRAMES:
                line = "???" if f.f_lineno is None else f.f_lineno
                lines.append(f'  File "{f.f_code.co_filename}", line {line} in {f.f_code.co_name}')
                f = f.f_back
            if f is not None:
                lines.append("  ...")
            blocks.append("\n".join(lines) + "\n")
        data = "\n".join(blocks).encode(errors="backslashreplace") + b"\n"
    except Exception as e:  # a failed dump must not break the code it interrupted
        data = f"stack dump failed: {e!r}\n".encode(errors="backslashreplace")
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data) :]


async def collect_dump(pid: int, dump_file: Path, timeout_s: float) -> str | None:
    """Signal ``pid`` to dump its stacks into ``dump_file`` and return the new dump (None: none came
    within ``timeout_s``, e.g. a stopped process): :data:`DUMP_SIGNAL`, then, when half the time
    brought nothing, :data:`FALLBACK_DUMP_SIGNAL` (see :func:`register_dump`)."""
    try:
        start = os.stat(dump_file).st_size
    except OSError:
        return None
    for sig in (DUMP_SIGNAL, FALLBACK_DUMP_SIGNAL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return None
        if await _grown(dump_file, start, timeout_s / 2):
            break
    else:
        return None
    with open(dump_file, "rb") as f:  # noqa: ASYNC230 (a small local file)
        f.seek(start)
        return f.read().decode(errors="replace")


async def _grown(dump_file: Path, start: int, timeout_s: float) -> bool:
    """Whether ``dump_file`` grows past ``start`` within ``timeout_s``; once it has, waits for it
    to stop growing."""
    deadline = time.monotonic() + timeout_s
    size = start
    # No event tells a file has grown: poll it. A dump is written at once, in one go.
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        with contextlib.suppress(OSError):
            now = os.stat(dump_file).st_size
            if now > start and now == size:  # grown, and done growing
                return True
            size = now
    return size > start
