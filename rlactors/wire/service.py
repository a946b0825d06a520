"""Serving objects' methods over a ROUTER socket.

One :class:`Service` per process hosts one or more targets (the actor in a worker; the
head and the node agent in a control process). For each CALL it looks up the public
method and runs it according to its kind:

* ``async def`` — a task on this loop, at most ``max_concurrency`` at once; started in
  arrival order, so calls from one caller begin in the order they were made;
* plain ``def`` — on one worker thread, strictly in order, so long compute never blocks
  the loop (pings and other calls keep being answered); or, for an actor declared with
  ``sync_methods="loop"`` (see :class:`rlactors.Actor`), on the loop as an ``async`` one;
* ``async def`` with ``yield`` (or a plain generator) — streamed item by item, with a
  credit window so a fast producer cannot flood a slow consumer.

A CANCEL cancels the task running that call. Malformed messages are logged and dropped.

Replies are held back, not piled up: when the backlog of messages to a caller that does not read
(slow, or stopped) is full (see :mod:`rlactors.wire.transport`), a finished call waits with its result,
and a stream before its next item, until the caller reads again or is disconnected; other callers'
replies are not held up. A reply to a caller that has gone is logged at warning with the actor and
the method it answered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from protocols.runtime import codec, wire
from protocols.runtime.wire import Flags, Kind
from rlactors.base.aio import wait_for
from rlactors.base.errors import MessageTooLargeError, exception_payload
from rlactors.base.forensics import CURRENT_CALL, LoopProbe, coroutine_stack, noted_waits, thread_stacks
from rlactors.base.logging import Throttle
from rlactors.wire.methods import ASYNC, ASYNCGEN, SYNC, backpressure_of, method_table, runs_on_loop
from rlactors.wire.security import Security, control_plane_act, is_control_plane
from rlactors.wire.transport import AsyncSocket, Outbox, bind_router, check_size

log = structlog.get_logger("rlactors.wire.service")
_bind = structlog.contextvars.bind_contextvars

STREAM_WINDOW = 256  # items a stream may run ahead of the consumer's acknowledgements
STREAM_CREDIT_TIMEOUT_S = 600.0  # no acknowledgement for this long ends the stream
LOG_EVERY_S = 10.0  # a flood of malformed messages logs one line per this many seconds
# Every service answers ``activity()`` under this target, from its loop, ahead of max_concurrency.
ACTIVITY_TARGET = "__service__"


def _on_loop(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A plain method as an ``async`` one: it runs on the loop, in one go."""

    @functools.wraps(fn)
    async def run(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return run


class _Credit:
    __slots__ = ("acked", "event", "sent")

    def __init__(self) -> None:
        self.sent = 0
        self.acked = 0
        self.event = asyncio.Event()


class Service:
    """Hosts targets (objects) and answers CALLs to their public methods."""

    def __init__(
        self, *, name: str, max_concurrency: int | None = 1000, security: Security | None = None
    ) -> None:
        self.name = name
        self.security = security
        self._targets: dict[str | None, dict[str, tuple[Callable[..., Any], str]]] = {}
        # (target, method) of control-plane methods -> what each does, for the refusal
        self._control: dict[tuple[str | None, str], str] = {}
        # None: unbounded (the head: its long-polls and event streams must never starve control calls).
        self._sem: asyncio.Semaphore | contextlib.nullcontext[None] = (
            asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
        )
        self._cancelled: set[tuple[bytes, int]] = set()  # calls their caller cancelled
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"{name}-sync"
        )
        self._running: dict[tuple[bytes, int], asyncio.Task[Any] | asyncio.Future[Any]] = {}
        self._credits: dict[tuple[bytes, int], _Credit] = {}
        self._started: dict[tuple[bytes, int], tuple[str, float]] = {}  # running call -> (method, start)
        # Forensics (stacks()): async calls past max_concurrency, the sync call on the thread now,
        # this process's outgoing calls (the worker sets it) and its loop's lag probe.
        self._admitted: set[tuple[bytes, int]] = set()
        self._sync_now: tuple[tuple[bytes, int], int] | None = None  # (call, thread ident)
        self.max_concurrency = max_concurrency
        self.outgoing: Callable[[], list[dict[str, Any]]] | None = None
        self.collective: Callable[[], dict[str, Any] | None] | None = None  # the group it joined
        self._backpressure: dict[str, str] = {}  # method -> why its wait is by design
        self.probe: LoopProbe | None = None
        self._asock: AsyncSocket | None = None
        self._outbox: Outbox | None = None
        self.address = ""
        self.dropped = 0  # malformed messages dropped
        self._drop_log = Throttle(log, "dropped malformed messages", LOG_EVERY_S)
        self._lost_log = Throttle(log, "reply not delivered: its caller is gone", LOG_EVERY_S)

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The single thread that runs sync methods (constructors may run here too)."""
        return self._executor

    def add(self, target: str | None, obj: Any) -> dict[str, str]:
        """Serve ``obj``'s public methods under ``target`` (None: the default target)."""
        table: dict[str, tuple[Callable[..., Any], str]] = {}
        for mname, kind in method_table(obj).items():
            fn = getattr(obj, mname)
            if kind == SYNC and runs_on_loop(obj, fn):
                fn, kind = _on_loop(fn), ASYNC
            table[mname] = (fn, kind)
            if is_control_plane(fn):
                self._control[(target, mname)] = control_plane_act(fn)
            if backpressure_of(fn) and target is None:
                self._backpressure[mname] = backpressure_of(fn)
        self._targets[target] = table
        return {k: v[1] for k, v in table.items()}

    def bind(self, address: str) -> str:
        self._asock, self.address = bind_router(
            address, self._on_message, self.security, name=self.name, on_too_large=self._refuse_too_large
        )
        self._asock.on_undeliverable = self._undeliverable
        self._outbox = Outbox(self._asock, routed=True)
        return self.address

    async def close(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
        self._running.clear()
        if self._outbox is not None:
            self._outbox.flush()
        if self._asock is not None:
            self._asock.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- incoming ------------------------------------------------------------------------------

    def _on_message(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self._drop("message without a body")
            return
        ident = frames[0].bytes
        try:
            envelopes = wire.split_batch(frames[1:])
        except wire.WireError as e:
            self._drop(str(e))
            return
        for env in envelopes:
            try:
                msg = wire.decode_envelope(env)
            except wire.WireError as e:
                self._reject(ident, env, e)
                continue
            kind, call_id = msg[0], msg[1]
            if kind == Kind.CALL and (msg[2], msg[3]) in self._control and not self._has_control(frames):
                self._refuse_control(ident, call_id, msg[2], msg[3], msg[6])
            elif kind == Kind.CALL:
                self._on_call(ident, call_id, *msg[2:])
            elif kind == Kind.CANCEL:
                task = self._running.get((ident, call_id))
                if task is not None:
                    self._cancelled.add((ident, call_id))
                    task.cancel()
            elif kind == Kind.STREAM_ACK:
                credit = self._credits.get((ident, call_id))
                if credit is not None and isinstance(msg[2], int):
                    credit.acked = max(credit.acked, msg[2])
                    credit.event.set()
            elif kind == Kind.PING:
                self._send(ident, wire.encode_envelope(Kind.PONG, call_id))
            else:
                self._drop(f"unexpected {Kind(kind).name} envelope")

    def _has_control(self, frames: list[Any]) -> bool:
        return self.security is None or self.security.peer_has_control(frames[1:])

    def _refuse_control(
        self, ident: bytes, call_id: int, target: str | None, method: str, flags: int
    ) -> None:
        """A control-plane call from a peer that holds only the call credential (a worker)."""
        log.warning("refused a control-plane call from a peer without the control credential", method=method)
        if not flags & Flags.NO_REPLY:
            act = self._control.get((target, method), "")
            what = f"{act} ({target or self.name}.{method})" if act else f"{target or self.name}.{method}"
            err = PermissionError(
                f"{what} needs the cluster's control credential, and this process "
                "holds only the call credential (what workers get): call it from the driver, or spawn "
                "this actor with control=True"
            )
            self._send_error(ident, call_id, err)

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        self._drop_log(service=self.name, reason=reason, total=self.dropped)

    def _refuse_too_large(self, frames: list[Any], why: str) -> None:
        """A message over our max_message_bytes (its sender's bound is larger): fail its calls."""
        self.dropped += 1
        with contextlib.suppress(wire.WireError):
            for env in wire.split_batch(frames[1:]):
                header = wire.peek_header(env)
                if header is not None and header[0] == Kind.CALL and not header[2] & Flags.NO_REPLY:
                    self._send_error(
                        frames[0].bytes,
                        header[1],
                        MessageTooLargeError(f"{self.name} refused the call: {why}"),
                    )

    def _reject(self, ident: bytes, env: Any, err: Exception) -> None:
        """An envelope that failed to decode: answer its call if we can still read its id."""
        self._drop(str(err))
        header = wire.peek_header(env)
        if header is not None and header[0] == Kind.CALL and not header[2] & Flags.NO_REPLY:
            self._send_error(ident, header[1], err)

    def _on_call(
        self,
        ident: bytes,
        call_id: int,
        target: str | None,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
        flags: int,
    ) -> None:
        if target == ACTIVITY_TARGET and method == "activity":
            self._send_result(ident, call_id, self.activity(), method)
            return
        if target == ACTIVITY_TARGET and method == "stacks":
            self._send_result(ident, call_id, self.stacks(), method)
            return
        methods = self._targets.get(target)
        entry = methods.get(method) if methods is not None else None
        if entry is None:
            what = f"{self.name}" if target is None else f"{self.name}/{target}"
            err = AttributeError(f"{what} has no public method {method!r}")
            if not flags & Flags.NO_REPLY:
                self._send_error(ident, call_id, err, method)
            return
        fn, kind = entry
        key = (ident, call_id)
        loop = asyncio.get_running_loop()
        if kind == ASYNC:
            self._running[key] = loop.create_task(self._run_async(key, fn, args, kwargs, flags))
        elif kind == SYNC:
            ctx = contextvars.copy_context()
            ctx.run(_bind, method=fn.__name__, call=call_id)
            ctx.run(CURRENT_CALL.set, method)
            fut = loop.run_in_executor(
                self._executor, functools.partial(ctx.run, self._in_thread, key, fn, *args, **kwargs)
            )
            self._running[key] = fut
            fut.add_done_callback(functools.partial(self._sync_done, key, flags, method))
        else:
            self._credits[key] = _Credit()
            self._running[key] = loop.create_task(self._run_stream(key, fn, kind, args, kwargs))
        self._started[key] = (method, time.monotonic())
        self._running[key].add_done_callback(lambda _: self._started.pop(key, None))

    def activity(self) -> dict[str, Any]:
        """What this service is doing: how many calls run, and the oldest one's method and age."""
        now = time.monotonic()
        oldest = min(self._started.values(), key=lambda c: c[1], default=None)
        return {
            "running": len(self._started),
            "oldest_method": oldest[0] if oldest else None,
            "oldest_s": round(now - oldest[1], 3) if oldest else 0.0,
        }

    def stacks(self) -> dict[str, Any]:
        """What this process is doing, for ``cluster.stacks()``: each incoming call (method, age,
        its await chain or its thread's stack; queued behind max_concurrency or the sync thread, or
        running), its outgoing calls, the waits its code noted (:func:`rlactors.base.forensics.waiting`),
        every thread's stack and the loop's lag."""
        now = time.monotonic()
        threads = thread_stacks()
        by_ident = {t["ident"]: t["stack"] for t in threads}
        incoming = []
        for key, (method, start) in self._started.items():
            task = self._running.get(key)
            entry: dict[str, Any] = {"call_id": key[1], "method": method, "age_s": round(now - start, 3)}
            if method in self._backpressure:
                entry["backpressure"] = self._backpressure[method]
            if isinstance(task, asyncio.Task):
                queued = key not in self._admitted and not isinstance(self._sem, contextlib.nullcontext)
                entry["state"] = "queued" if queued and key not in self._credits else "running"
                entry["stack"] = coroutine_stack(task.get_coro())
            elif self._sync_now is not None and self._sync_now[0] == key:
                entry["state"], entry["stack"] = "running", by_ident.get(self._sync_now[1], [])
                entry["thread"] = True
            else:
                entry["state"], entry["stack"] = "queued", []  # behind the sync thread's current call
                entry["thread"] = True
            incoming.append(entry)
        return {
            "pid": os.getpid(),
            "max_concurrency": self.max_concurrency,
            "incoming": incoming,
            "outgoing": self.outgoing() if self.outgoing is not None else [],
            "waits": noted_waits(),
            "threads": [{"name": t["name"], "stack": t["stack"]} for t in threads],
            "loop": self.probe.report() if self.probe is not None else None,
            "loop_thread": threading.get_ident(),
            "collective": self.collective() if self.collective is not None else None,
        }

    def _in_thread(self, key: tuple[bytes, int], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a sync method on the worker thread, noting which call it is (for stacks())."""
        self._sync_now = (key, threading.get_ident())
        try:
            return fn(*args, **kwargs)
        finally:
            self._sync_now = None

    # --- running -------------------------------------------------------------------------------

    async def _run_async(
        self,
        key: tuple[bytes, int],
        fn: Callable[..., Any],
        args: list[Any],
        kwargs: dict[str, Any],
        flags: int,
    ) -> None:
        ident, call_id = key
        name = getattr(fn, "__name__", "?")
        # This task runs in its own copy of the context: bind the call for log lines it emits.
        _bind(method=name, call=call_id)
        CURRENT_CALL.set(name)
        try:
            async with self._sem:
                self._admitted.add(key)
                result = await fn(*args, **kwargs)
        except asyncio.CancelledError:
            if key in self._cancelled:
                return  # the caller cancelled: nobody is waiting
            if not flags & Flags.NO_REPLY:  # cancelled inside the actor: the caller must not wait forever
                self._send_error(ident, call_id, RuntimeError(f"{name} was cancelled inside the actor"), name)
        except Exception as e:  # a served method's own exception, whatever it is, goes back to its caller
            if flags & Flags.NO_REPLY:
                log.exception("told method failed", service=self.name, method=name)
            else:
                self._send_error(ident, call_id, e, name)
        else:
            if not flags & Flags.NO_REPLY:
                asock = self._asock
                if asock is not None and asock.full(ident):  # the caller does not read: hold the reply
                    await asock.room(ident)
                self._send_result(ident, call_id, result, name)
        finally:
            self._running.pop(key, None)
            self._cancelled.discard(key)
            self._admitted.discard(key)

    def _sync_done(self, key: tuple[bytes, int], flags: int, method: str, fut: asyncio.Future[Any]) -> None:
        self._running.pop(key, None)
        if fut.cancelled():
            if key not in self._cancelled and not flags & Flags.NO_REPLY:
                err = RuntimeError("the call was cancelled inside the actor")
                self._send_error(key[0], key[1], err, method)
            self._cancelled.discard(key)
            return
        exc = fut.exception()
        if flags & Flags.NO_REPLY:
            if exc is not None:
                log.error("told method failed", service=self.name, error=repr(exc))
            return
        if exc is not None:
            self._send_error(key[0], key[1], exc, method)
        elif self._asock is not None and self._asock.full(key[0]):  # the caller does not read
            task = asyncio.get_running_loop().create_task(self._reply_later(key, fut.result(), method))
            self._running[key] = task  # a CANCEL or close() cancels it
        else:
            self._send_result(key[0], key[1], fut.result(), method)

    async def _reply_later(self, key: tuple[bytes, int], result: Any, method: str) -> None:
        """Send a sync call's result once its caller's backlog has room."""
        try:
            if self._asock is not None:
                await self._asock.room(key[0])
            self._send_result(key[0], key[1], result, method)
        finally:
            self._running.pop(key, None)
            self._cancelled.discard(key)

    async def _run_stream(
        self,
        key: tuple[bytes, int],
        fn: Callable[..., Any],
        kind: str,
        args: list[Any],
        kwargs: dict[str, Any],
    ) -> None:
        ident, call_id = key
        credit = self._credits[key]
        name = getattr(fn, "__name__", "?")
        # Streams do not count against max_concurrency: a stream parked on its credit window
        # (a slow or vanished consumer) must not hold a slot other calls need.
        try:
            if kind == ASYNCGEN:
                agen = fn(*args, **kwargs)
                try:
                    async for item in agen:
                        await self._stream_item(ident, call_id, credit, item, name)
                finally:
                    await agen.aclose()
            else:
                loop = asyncio.get_running_loop()
                it = await loop.run_in_executor(self._executor, lambda: iter(fn(*args, **kwargs)))
                done = object()
                while (item := await loop.run_in_executor(self._executor, next, it, done)) is not done:
                    await self._stream_item(ident, call_id, credit, item, name)
            self._send(ident, wire.encode_envelope(Kind.STREAM_END, call_id), name)
        except asyncio.CancelledError:
            if key not in self._cancelled:
                err = RuntimeError("the stream was cancelled inside the actor")
                self._send_error(ident, call_id, err, name)
        except TimeoutError:
            log.warning(
                "stream consumer stopped acknowledging; stream ended", service=self.name, call=call_id
            )
        except Exception as e:  # a stream's own exception, whatever it is, goes back to its caller
            self._send_error(ident, call_id, e, name)
        finally:
            self._running.pop(key, None)
            self._credits.pop(key, None)
            self._cancelled.discard(key)

    async def _stream_item(self, ident: bytes, call_id: int, credit: _Credit, item: Any, method: str) -> None:
        while credit.sent - credit.acked >= STREAM_WINDOW:
            credit.event.clear()
            # A consumer that acknowledges nothing for this long is gone (its process died).
            await wait_for(credit.event.wait(), STREAM_CREDIT_TIMEOUT_S)
        if self._asock is not None and self._asock.full(ident):  # the consumer does not read
            await self._asock.room(ident)
        credit.sent += 1
        env = wire.encode_envelope(Kind.STREAM_ITEM, call_id, item)
        check_size(env, f"an item streamed by {self.name}")  # raises: the stream ends with the error
        self._send(ident, env, method)

    # --- outgoing ------------------------------------------------------------------------------

    def _send(self, ident: bytes, envelope: list[Any], method: str | None = None) -> None:
        """Queue one envelope to ``ident``; ``method``: the one it answers, named if it is lost."""
        if self._outbox is not None:
            self._outbox.put(envelope, ident, method)

    def _send_result(self, ident: bytes, call_id: int, value: Any, method: str | None = None) -> None:
        try:
            env = wire.encode_envelope(Kind.RESULT, call_id, value)
            check_size(env, f"the result of a call to {self.name}")
        except (codec.CodecError, MessageTooLargeError) as e:
            self._send_error(ident, call_id, e, method)
            return
        self._send(ident, env, method)

    def _send_error(self, ident: bytes, call_id: int, exc: BaseException, method: str | None = None) -> None:
        payload = exception_payload(exc, where=self.name)
        if hasattr(exc, "actor_id"):
            payload["actor_id"] = exc.actor_id
        self._send(ident, wire.encode_envelope(Kind.ERROR, call_id, payload), method)

    def _undeliverable(self, peer: bytes | None, methods: list[Any]) -> None:
        """Replies to a caller that has gone (its process exited, or it reconnected as a new peer)."""
        names = sorted({m for m in methods if m})
        # Throttled: a caller that dies with many calls in flight loses a reply per loop turn.
        self._lost_log(actor=self.name, method=", ".join(names) if names else None, replies=len(methods))
