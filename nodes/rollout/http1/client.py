"""The client side: keep-alive connection pools to one server each, a request at a time per
connection, answers read by httptools' response parser.

An answer is framed by ``Content-Length``, by chunks (trailers read and dropped), or by the
server closing the connection; informational answers (``100 Continue``, ``103 Early Hints``)
are skipped for the one that follows. A connection is reused only when its last answer came whole,
the server keeps it alive and nothing arrived after it (bytes after an answer, or while no request
is out, belong to no request: the connection is closed rather than let them answer the next one).
Whatever a server sends, a request ends: with its answer, or with :class:`ClientError` when the
answer is malformed, cut short, an upgrade, or late.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Mapping
from ssl import SSLContext
from typing import Any

import httptools

from rlactors.base.aio import wait_for

__all__ = ["ClientError", "ClientPool", "LineSink"]


class ClientError(Exception):
    """No HTTP answer came: ``timed_out`` when the request may still run at the server."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


LineSink = Callable[[bytes], None]  # gets an event stream's lines, without their b"\n"

_NO_BODY = (204, 304)  # statuses whose answers have no body, whatever their headers say


class _ClientConnection(asyncio.Protocol):
    """One keep-alive connection to a server: one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._answer: asyncio.Future[tuple[int, bytes]] | None = None
        self._body: list[bytes] = []
        self._lines: LineSink | None = None  # an event stream's lines go here as they arrive
        self._rest = b""  # an unfinished line
        self._event_stream = False  # the answer's Content-Type is text/event-stream
        self._streaming = False  # ... and its lines go to _lines
        self._framed = False  # the answer has a Content-Length or chunks (else: it ends at close)
        self._in_head = False  # between the status line and the end of the headers
        self._until_close = False  # headers read; the body runs until the server closes
        self._keep = False

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._answer is None or self._answer.done():
            return
        if self._until_close:  # a body delimited by the close: this was its end
            self._until_close = False
            self._complete()
        else:
            self._fail(ConnectionResetError(f"the server closed the connection ({exc})"))

    def data_received(self, data: bytes) -> None:
        if self._answer is None or self._answer.done():
            self.close()  # bytes no request asked for: this connection's framing is lost
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ConnectionError("the server switched protocols (an upgrade), not an HTTP answer"))
            self.close()
        except httptools.HttpParserError as e:
            self._fail(ConnectionError(f"bad HTTP answer: {e}"))
            self.close()

    # -- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._answer is None or self._answer.done():
            self.close()  # a second answer after the one asked for (see data_received)
            raise ConnectionError("an answer no request asked for")
        self._body, self._rest, self._event_stream, self._framed = [], b"", False, False
        self._in_head = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a trailer: nothing here reads one
        name = name.lower()
        if name == b"content-type":
            self._event_stream = value.startswith(b"text/event-stream")
        elif name in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        status = self.parser.get_status_code()
        self._streaming = self._lines is not None and self._event_stream and status == 200
        self._until_close = not self._framed and status >= 200 and status not in _NO_BODY

    def on_body(self, body: bytes) -> None:
        if not self._streaming:
            self._body.append(body)
            return
        *lines, self._rest = (self._rest + body).split(b"\n")
        for line in lines:
            self._lines(line)  # type: ignore[misc]

    def on_message_complete(self) -> None:
        if 100 <= self.parser.get_status_code() < 200:
            return  # informational (100 Continue, 103 Early Hints): the answer follows
        self._until_close = False
        self._keep = self.parser.should_keep_alive()
        self._complete()

    # -- the request ---------------------------------------------------------------------------

    def _complete(self) -> None:
        if self._streaming and self._rest:
            self._lines(self._rest)  # type: ignore[misc]
        body = b"" if self._streaming else self._body[0] if len(self._body) == 1 else b"".join(self._body)
        if self._answer is not None and not self._answer.done():
            self._answer.set_result((self.parser.get_status_code(), body))

    def _fail(self, error: Exception) -> None:
        self._keep = False
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(error)

    async def request(self, data: bytes, lines: LineSink | None, timeout: float | None) -> tuple[int, bytes]:
        """Send ``data`` (a whole request) and wait for its answer."""
        assert self.transport is not None
        self._answer = asyncio.get_running_loop().create_future()
        self._body, self._lines, self._rest, self._keep = [], lines, b"", False
        self._event_stream = self._streaming = self._until_close = False
        self.transport.write(data)
        try:
            return await _wait(self._answer, timeout)
        finally:
            self._lines = None

    @property
    def reusable(self) -> bool:
        """The last answer came whole and the server keeps the connection open."""
        return (
            self._keep and not self.closed and self.transport is not None and not self.transport.is_closing()
        )

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


async def _wait(fut: asyncio.Future[Any], timeout: float | None) -> Any:
    """``fut``'s result, or TimeoutError after ``timeout`` seconds (None: no limit): one timer that
    fails the future, no task (``wait_for`` wraps the wait in one)."""
    if timeout is None:
        return await fut

    def expire() -> None:
        if not fut.done():
            fut.set_exception(TimeoutError(f"no answer in {timeout:g} s"))

    timer = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        return await fut
    finally:
        timer.cancel()


class ClientPool:
    """Keep-alive connections to one server (``host:port``; over TLS with ``ssl``), at most
    ``max_connections`` (more requests wait for one). A connection idle for ``keepalive_s`` is
    closed, not reused: the server may be closing it (SGLang's uvicorn closes one idle for 5 s)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int,
        keepalive_s: float,
        connect_timeout_s: float,
        ssl: SSLContext | None = None,
    ) -> None:
        self.host, self.port, self.ssl = host, port, ssl
        self.max_connections, self.keepalive_s = max_connections, keepalive_s
        self.connect_timeout_s = connect_timeout_s
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._host_header = f"Host: {netloc}\r\n".encode()
        self._idle: list[_ClientConnection] = []
        self._all: set[_ClientConnection] = set()
        self._opening = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def request(
        self,
        method: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        timeout: float | None,
        lines: LineSink | None = None,
    ) -> tuple[int, bytes]:
        """One request: (status, body). With ``lines``, a 200 event-stream answer's lines go there
        as they arrive and its body comes back empty. :class:`ClientError` when no answer came;
        ``timeout`` bounds the answer (not the wait for a connection)."""
        head = b"%s %s HTTP/1.1\r\n%sContent-Length: %d\r\n%s\r\n" % (
            method.encode(),
            path.encode(),
            self._host_header,
            len(body),
            b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in headers.items()),
        )
        conn = await self._take()
        try:
            return await conn.request(head + body, lines, timeout)
        except TimeoutError as e:
            conn.close()
            raise ClientError(f"TimeoutError: {e}", timed_out=True) from None
        except ConnectionError as e:
            conn.close()
            raise ClientError(f"{type(e).__name__}: {e}", timed_out=False) from None
        except BaseException:  # cancelled or anything else mid-answer
            conn.close()  # cancelled mid-answer: what comes next on it is unknown
            raise
        finally:
            self._give_back(conn)

    async def _take(self) -> _ClientConnection:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed and now - conn.idle_since < self.keepalive_s:
                    return conn
                conn.close()
                self._all.discard(conn)
            if len(self._all) + self._opening < self.max_connections:
                break
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:  # cancelled too: the turn is passed on
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken, then cancelled: the turn goes to the next waiter
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
                raise
        self._opening += 1
        try:
            _, conn = await wait_for(
                loop.create_connection(_ClientConnection, self.host, self.port, ssl=self.ssl),
                self.connect_timeout_s,
            )
        except (OSError, TimeoutError) as e:
            raise ClientError(
                f"connect to {self.host}:{self.port}: {type(e).__name__}: {e}", timed_out=False
            ) from None
        finally:
            self._opening -= 1
            self._wake()
        self._all.add(conn)
        return conn

    def _give_back(self, conn: _ClientConnection) -> None:
        if conn.reusable:
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)
        else:
            conn.close()
            self._all.discard(conn)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        """Close every connection (a request on one fails with :class:`ClientError`)."""
        for conn in self._all:
            conn.close()
        self._all.clear()
        self._idle.clear()
