"""The server side: what the OpenAI-compatible endpoint serves on, over asyncio transports and
httptools' request parser.

Each chat call the endpoint serves costs its process one HTTP exchange on top of the generation it
wraps, and that exchange is most of what the endpoint may add: this layer costs less CPU per call
than an aiohttp web server or uvicorn with a bare ASGI app (measured side by side in
bench/RESULTS.md, "OpenAI-compatible endpoint"). It does what the endpoint needs and no more:
keep-alive and pipelined requests (answered in order), ``Content-Length`` and chunked request
bodies up to a size cap, ``Expect: 100-continue``, whole responses and chunked streams
(server-sent events) with write back-pressure, an idle timeout. Malformed HTTP is answered 400 and
the connection closed; nothing a client sends stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httptools
import structlog

__all__ = ["ErrorBody", "HTTPServer", "Handler", "Request", "Response", "Stream"]

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
