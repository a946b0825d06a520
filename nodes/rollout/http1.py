"""A lean HTTP/1.1 server over asyncio transports and httptools (uvicorn's C parser): what the
OpenAI-compatible endpoint serves on.

Each chat call the endpoint serves costs its process one HTTP exchange on top of the generation it
wraps, and that exchange is most of what the endpoint may add: this layer costs less CPU per call
than an aiohttp web server or uvicorn with a bare ASGI app (measured side by side in
bench/RESULTS.md, "OpenAI-compatible endpoint"). It does what the endpoint needs and no more: keep-alive and pipelined requests (answered in order),
``Content-Length`` and chunked request bodies up to a size cap, ``Expect: 100-continue``, whole
responses and chunked streams (server-sent events) with write back-pressure, an idle timeout.
Malformed HTTP is answered 400 and the connection closed; nothing a client sends stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from ssl import SSLContext
from typing import Any

import httptools
import structlog

from rlactors.aio import wait_for

__all__ = ["ClientError", "ClientPool", "HTTPServer", "Request", "Response", "Stream"]

log = structlog.get_logger(__name__)

IDLE_TIMEOUT_S = 75.0  # a keep-alive connection with no request this long is closed (aiohttp's)
MAX_QUEUED = 16  # pipelined requests read ahead of the one being answered; then reading pauses
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


@dataclass(slots=True)
class Response:
    """A whole answer: status, body, content type, extra headers."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Request:
    """One request, its body read whole. ``stream`` starts a streamed answer instead of returning
    a :class:`Response` from the handler."""

    method: str
    path: str  # without the query string
    query: str
    headers: dict[str, str]  # names lower-case
    body: bytes
    _conn: _Connection

    async def stream(self, status: int = 200, headers: dict[str, str] | None = None) -> Stream:
        """Send the status line and ``headers`` now; the body follows in chunks."""
        return self._conn.start_stream(status, headers or {})


Handler = Callable[[Request], Awaitable[Response | None]]
ErrorBody = Callable[[int, str], Response]  # an answer of the server's own (400, 413, 500)


class Stream:
    """A streamed answer (chunked transfer encoding; close-delimited for HTTP/1.0)."""

    def __init__(self, conn: _Connection, chunked: bool) -> None:
        self._conn, self._chunked = conn, chunked
        self.ended = False

    async def write(self, data: bytes) -> None:
        """Send ``data``; waits while the client reads slower than this writes. ConnectionError
        once the client has gone."""
        if not data:
            return
        self._conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        await self._conn.drain()

    async def end(self) -> None:
        """The last chunk (once)."""
        if not self.ended:
            self.ended = True
            if self._chunked and not self._conn.gone:
                self._conn.write(b"0\r\n\r\n")


class _TooLarge(Exception):
    pass


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them one at a time, in order."""

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.gone = False
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._queue: deque[tuple[Request, bool, bool]] = deque()  # (request, keep-alive, HTTP/1.0)
        self._http10 = False  # the request being answered is HTTP/1.0 (no chunks, no keep-alive)
        self._task: asyncio.Task[None] | None = None  # the request being answered
        self._paused_reading = False
        self._drained: asyncio.Future[None] | None = None  # set while the transport's buffer is full
        self._idle: asyncio.TimerHandle | None = None
        self._streaming: Stream | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server._connections.add(self)
        self._idle = self.loop.call_later(IDLE_TIMEOUT_S, self.close)

    def data_received(self, data: bytes) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _TooLarge):
                self._refuse(413, f"the request body is larger than {self.server.max_body} bytes")
            else:
                self._refuse(400, "bad HTTP request")
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            self._refuse(400, f"bad HTTP request: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.server._connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)  # drain() raises on waking, as the connection is gone

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = b"", {}, [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        length = self._headers.get("content-length", "")
        if length.isdigit() and int(length) > self.server.max_body:
            raise _TooLarge
        if self._headers.get("expect", "").lower() == "100-continue":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.server.max_body:
            raise _TooLarge
        self._body.append(body)

    def on_message_complete(self) -> None:
        path, _, query = self._url.decode("latin-1").partition("?")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = Request(self.parser.get_method().decode(), path, query, self._headers, body, self)
        self._queue.append((req, self.parser.should_keep_alive(), self.parser.get_http_version() == "1.0"))
        if self._task is None:
            self._next()
        elif len(self._queue) >= MAX_QUEUED and not self._paused_reading and self.transport is not None:
            self._paused_reading = True
            self.transport.pause_reading()

    # -- answering ---------------------------------------------------------------------------

    def _next(self) -> None:
        req, keep_alive, self._http10 = self._queue.popleft()
        if self._paused_reading and len(self._queue) < MAX_QUEUED // 2 and self.transport is not None:
            self._paused_reading = False
            self.transport.resume_reading()
        self._task = self.loop.create_task(self._answer(req, keep_alive))

    async def _answer(self, req: Request, keep_alive: bool) -> None:
        keep_alive = keep_alive and not self._http10
        try:
            resp = await self.server.handler(req)
        except Exception as e:
            log.exception("http1.handler_error", path=req.path)
            resp = None if self._streaming else self.server.error_body(500, f"{type(e).__name__}: {e}")
        if self._streaming is not None:
            with contextlib.suppress(ConnectionError):
                await self._streaming.end()
            keep_alive = keep_alive and self._streaming._chunked
            self._streaming = None
        elif resp is not None:
            with contextlib.suppress(ConnectionError):
                self._send(resp, keep_alive)
        self._task = None
        if not keep_alive:
            self.close()
        elif self._queue:
            self._next()
        elif not self.gone:
            self._idle = self.loop.call_later(IDLE_TIMEOUT_S, self.close)

    def _head(self, status: int, headers: dict[str, str], extra: bytes) -> bytes:
        lines = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in headers.items())
        return b"HTTP/1.1 %d %s\r\n%s%s\r\n" % (status, _REASONS.get(status, b""), lines, extra)

    def _send(self, resp: Response, keep_alive: bool) -> None:
        extra = b"Content-Type: %s\r\nContent-Length: %d\r\n" % (resp.content_type.encode(), len(resp.body))
        if not keep_alive:
            extra += b"Connection: close\r\n"
        self.write(self._head(resp.status, resp.headers, extra) + resp.body)

    def start_stream(self, status: int, headers: dict[str, str]) -> Stream:
        if self._streaming is not None:
            raise RuntimeError("this request's answer is already streaming")
        chunked = not self._http10
        extra = b"Transfer-Encoding: chunked\r\n" if chunked else b"Connection: close\r\n"
        self.write(self._head(status, headers, extra))
        self._streaming = Stream(self, chunked)
        return self._streaming

    def write(self, data: bytes) -> None:
        if self.gone or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        if self._drained is not None and not self._drained.done():
            await self._drained
        if self.gone:
            raise ConnectionResetError("the client closed the connection")

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request the parser could not take, and close: its bytes cannot be skipped."""
        self._queue.clear()
        with contextlib.suppress(ConnectionError):
            if self._task is None and self._streaming is None:
                self._send(self.server.error_body(status, message), keep_alive=False)
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class HTTPServer:
    """Serves ``handler`` (a request in, a :class:`Response` out, or ``None`` after streaming);
    ``error_body`` shapes the answers the server gives itself (bad HTTP, a body over ``max_body``
    bytes, a handler that raised)."""

    def __init__(self, handler: Handler, error_body: ErrorBody, max_body: int = 32 << 20) -> None:
        self.handler, self.error_body, self.max_body = handler, error_body, max_body
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        """Stop listening, drop every connection, cancel the answers in progress."""
        if self._server is None:
            return
        self._server.close()
        tasks: list[Any] = [c._task for c in self._connections if c._task is not None]
        for c in list(self._connections):
            c.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._server = None


# -- client ----------------------------------------------------------------------------------------


class ClientError(Exception):
    """No HTTP answer came: ``timed_out`` when the request may still run at the server."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


LineSink = Callable[[bytes], None]


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
        self._keep = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(ConnectionResetError(f"the server closed the connection ({exc})"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if self._answer is not None and not self._answer.done():
                self._answer.set_exception(ConnectionError(f"bad HTTP answer: {e}"))
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._event_stream = value.startswith(b"text/event-stream")

    def on_headers_complete(self) -> None:
        self._streaming = (
            self._lines is not None and self._event_stream and self.parser.get_status_code() == 200
        )

    def on_body(self, body: bytes) -> None:
        if not self._streaming:
            self._body.append(body)
            return
        *lines, self._rest = (self._rest + body).split(b"\n")
        for line in lines:
            self._lines(line)  # type: ignore[misc]

    def on_message_complete(self) -> None:
        if (
            100 <= self.parser.get_status_code() < 200
        ):  # informational (100 Continue, 103): the answer follows
            self._body, self._event_stream = [], False
            return
        if self._streaming and self._rest:
            self._lines(self._rest)  # type: ignore[misc]
        body = b"" if self._streaming else self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._keep = self.parser.should_keep_alive()
        if self._answer is not None and not self._answer.done():
            self._answer.set_result((self.parser.get_status_code(), body))

    async def request(self, data: bytes, lines: LineSink | None, timeout: float | None) -> tuple[int, bytes]:
        """Send ``data`` (a whole request) and wait for its answer."""
        assert self.transport is not None
        self._answer = asyncio.get_running_loop().create_future()
        self._body, self._lines, self._rest, self._keep = [], lines, b"", False
        self._event_stream = self._streaming = False
        self.transport.write(data)
        try:
            return await _wait(self._answer, timeout)
        finally:
            self._answer, self._lines = None, None

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
    ``max_connections`` (more requests wait for one). A connection idle for ``keepalive_s`` is closed, not reused: the server
    may be closing it (SGLang's uvicorn closes one idle for 5 s)."""

    def __init__(
        self, host: str, port: int, *, max_connections: int, keepalive_s: float, connect_timeout_s: float,
        ssl: SSLContext | None = None,
    ) -> None:  # fmt: skip
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
        self, method: str, path: str, body: bytes, headers: Mapping[str, str], timeout: float | None,
        lines: LineSink | None = None,
    ) -> tuple[int, bytes]:  # fmt: skip
        """One request: (status, body). With ``lines``, a 200 event-stream answer's lines go there
        as they arrive and its body comes back empty. :class:`ClientError` when no answer came;
        ``timeout`` bounds the answer (not the wait for a connection)."""
        head = b"%s %s HTTP/1.1\r\n%sContent-Length: %d\r\n%s\r\n" % (
            method.encode(), path.encode(), self._host_header, len(body),
            b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in headers.items()),
        )  # fmt: skip
        conn = await self._take()
        try:
            return await conn.request(head + body, lines, timeout)
        except TimeoutError as e:
            conn.close()
            raise ClientError(f"TimeoutError: {e}", timed_out=True) from None
        except ConnectionError as e:
            conn.close()
            raise ClientError(f"{type(e).__name__}: {e}", timed_out=False) from None
        except BaseException:
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
            except BaseException:
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
