"""The server side: what the OpenAI-compatible endpoint and online mode's session API serve on, over
asyncio transports and httptools' request parser (llhttp, strict).

Each chat call the endpoint serves costs its process one HTTP exchange on top of the generation it
wraps, and that exchange is most of what the endpoint may add: this layer costs less CPU per call
than an aiohttp web server or uvicorn with a bare ASGI app (measured side by side in
bench/RESULTS.md, "OpenAI-compatible endpoint"). It does what the endpoint needs and no more:
keep-alive and pipelined requests (answered in order), ``Content-Length`` and chunked request
bodies, ``Expect: 100-continue``, whole responses and chunked streams (server-sent events) with
write back-pressure.

It faces clients outside the cluster, so every resource a client can make it spend is bounded
(:class:`HTTPLimits`, each bound a setting; the table is docs/operate/http-limits.md): the size of
a request's head and its number of headers (414/431), the time its head and its body may take
(408, the connection closed, the peer counted and logged once a minute), the body's size (413), the
open connections (past the cap a new one is answered 503 and closed), the requests parsed ahead of
the one being answered, and what an answer may hold while its client does not read it: a stream's
writer waits once the transport's buffer is past its high-water mark (so does the next pipelined
request, unparsed, after a whole answer), and a connection whose client takes nothing of its
answer for ``send_timeout_s`` is reset (its streaming handler's next write
raises ConnectionError, as when a client goes away). ``gate`` sees each request's head before any
of its body is read (the API key's check: a refused request costs its head, never its body).
Malformed HTTP and every request smuggling shape (llhttp refuses them: Content-Length with
Transfer-Encoding, two Content-Lengths, obsolete line folding, bare LF or CR, invalid chunk sizes;
this layer, a transfer coding other than ``chunked`` and versions other than HTTP/1.0 and 1.1) is
answered 400 (501, 505) and the connection closed. No error body carries exception text: a handler that raised gets a 500 naming an id that
the server's log line carries. Nothing a client sends stops the server or delays another client.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import resource
import secrets
import socket
import struct
import termios
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httptools
import structlog

from protocols.runtime.codec import register
from rlactors.base.tomlconf import above, at_least, check_ranges

__all__ = ["ErrorBody", "Gate", "HTTPLimits", "HTTPServer", "Handler", "Request", "Response", "Stream"]

log = structlog.get_logger(__name__)

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
LOG_EVERY_S = 60.0  # a peer's refusals are logged at most once in this long (each is counted)
# connections accepted each time the listening socket is ready (asyncio's own servers accept up to
# their backlog); the rest wait for the loop's next turn
ACCEPT_BATCH = 256
ACCEPT_RETRY_S = 1.0  # after accept failed for want of descriptors or memory, as asyncio's servers
_LINGERING = 256  # refused connections kept open for their answer to be read; past it they are closed at once
_LINGER_S = 1.0  # how long a refused connection stays open (not read) for its answer to be read
_FD_SPARE = 256  # file descriptors kept for what the process opens besides connections
# the transport's write-buffer high-water mark: past it a stream's writer waits (Stream.write), so an
# answer its client does not read holds at most this, one chunk more, and the kernel's socket buffer
SEND_BUFFER = 64 * 1024
_SEND_CHECKS = 8  # progress checks per send_timeout_s while an answer waits in the transport's buffer
# Linux's SIOCOUTQ: the bytes a TCP socket holds that its peer has not acknowledged (where the ioctl
# is missing or fails, only the transport's buffer tells what the client took)
_OUTQ = getattr(termios, "TIOCOUTQ", None)

# the counters an HTTPServer keeps (HTTPServer.counters): what it refused, by reason
COUNTERS = (
    "http_slow_clients",
    "http_refused_connections",
    "http_bad_requests",
    "http_unauthorized",
    "http_stalled_readers",
)


@register
@dataclass
class HTTPLimits:
    """The bounds of an HTTP server that takes requests from outside the cluster (the table:
    docs/operate/http-limits.md)."""

    # request line and headers together (bytes, without optional whitespace): past it 414 for the
    # request line, else 431; the connection is closed
    max_head_bytes: int = field(default=16384, metadata=at_least(256))
    max_headers: int = field(default=100, metadata=at_least(1))  # header lines in one request: past it 431
    max_body_bytes: int = field(default=32 << 20, metadata=at_least(0))  # a request body: past it 413
    # from a request's first byte to the end of its head; past it 408, the connection closed, the
    # peer counted (http_slow_clients) and logged at most once a minute
    head_timeout_s: float = field(default=30.0, metadata=above(0))
    # a body's deadline, from the end of its head: this, plus its length at body_min_rate (a
    # chunked body's grows as it arrives); past it as head_timeout_s
    body_timeout_s: float = field(default=30.0, metadata=above(0))
    body_min_rate: int = field(default=65536, metadata=at_least(1))  # bytes/s a body's deadline allows for
    # a keep-alive connection idle this long is closed
    idle_timeout_s: float = field(default=75.0, metadata=above(0))
    # open connections; past it a new one is answered 503 with Retry-After and closed (the open
    # ones are served as before)
    max_connections: int = field(default=4096, metadata=at_least(1))
    # pipelined requests parsed from one read (the rest of the read is not parsed; the connection is
    # closed after their answers); nothing more is read while they are answered
    max_pipelined: int = field(default=8, metadata=at_least(1))
    retry_after_s: int = field(default=1, metadata=at_least(0))  # a 503's Retry-After (past max_connections)
    # an answer of which the client takes nothing (no byte acknowledged while some waits to be sent)
    # for this long has its connection reset, counted (http_stalled_readers) and logged at most
    # once a minute; a handler streaming to it gets ConnectionError, as when a client goes away
    send_timeout_s: float = field(default=60.0, metadata=above(0))
    # connections the kernel holds while they wait to be accepted (listen's backlog, capped by
    # net.core.somaxconn): past it new ones are dropped or reset before the server sees them, so it
    # must hold a burst of (re)connecting clients
    backlog: int = field(default=4096, metadata=at_least(1))

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass(slots=True)
class Response:
    """A whole answer: status, body, content type, extra headers."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Request:
    """One request, its body read whole (empty while ``gate`` sees its head). ``stream`` starts a
    streamed answer instead of returning a :class:`Response` from the handler."""

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
ErrorBody = Callable[[int, str], Response]  # an answer of the server's own (400, 413, 500, ...)
Gate = Callable[[Request], Response | None]  # a request's head, before its body: a refusal, or None


class Stream:
    """A streamed answer (chunked transfer encoding; close-delimited for HTTP/1.0)."""

    def __init__(self, conn: _Connection, chunked: bool) -> None:
        self._conn, self._chunked = conn, chunked
        self.ended = False

    async def write(self, data: bytes) -> None:
        """Send ``data``; waits while the client reads slower than this writes (the transport's
        buffer past :data:`SEND_BUFFER`). ConnectionError once the client has gone, or once it has
        taken nothing for ``send_timeout_s`` (its connection reset)."""
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


class _Refusal(Exception):
    """Raised from a parser callback: answer ``status`` (or ``response``) and close."""

    def __init__(
        self, status: int, message: str, counter: str = "http_bad_requests", response: Response | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.counter, self.response = status, message, counter, response


class _Stop(Exception):
    """Raised from a parser callback: parse no further (max_pipelined requests are queued)."""


# the connection's deadline, by what it waits for
_IDLE, _HEAD, _BODY = 1, 2, 3


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them one at a time, in order."""

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server._loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.gone = False
        self.refused = False  # past max_connections: answered 503, closing
        self._url: list[bytes] = []
        self._url_size = 0
        self._headers: dict[str, str] = {}
        self._head_size = 0  # the request line's and headers' bytes so far (exact, parsed)
        self._head_read = 0  # bytes of reads spent wholly on the current head (its unparsed part too)
        self._n_headers = 0
        self._in_message = False  # a request has begun and not ended
        self._head_done = False  # ... and its head is complete
        self._begun = 0  # requests begun in the read being parsed
        self._req: Request | None = None
        self._body: list[bytes] = []
        self._size = 0
        self._queue: deque[tuple[Request, bool, bool]] = deque()  # (request, keep-alive, HTTP/1.0)
        self._overflow = False  # max_pipelined reached: close once the queued ones are answered
        self._stash: bytes = b""  # read while a request was answered: parsed after its answer
        self._http10 = False  # the request being answered is HTTP/1.0 (no chunks, no keep-alive)
        self._task: asyncio.Task[None] | None = None  # the request being answered
        self._paused_reading = False
        self._drained: asyncio.Future[None] | None = None  # set while the transport's buffer is full
        self._socket: Any = None  # the transport's socket: what the kernel holds of the answers
        self._written = 0  # bytes given to the transport
        self._sent_timer: asyncio.TimerHandle | None = None  # runs while the transport holds bytes
        self._delivered = 0  # bytes the client had taken at the last check that saw it take more
        self._delivered_at = 0.0  # ... and when
        self._streaming: Stream | None = None
        # one timer per connection: it fires at or before _deadline and acts on _waiting then
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._waiting = 0  # _IDLE, _HEAD, _BODY; 0: no deadline (a request is being answered)
        self._body_start = 0.0

    # -- deadlines ---------------------------------------------------------------------------

    def _arm(self, waiting: int, delay: float) -> None:
        self._waiting, self._deadline = waiting, self.loop.time() + delay
        if self._timer is None or self._timer.when() > self._deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(self._deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if not self._waiting or self.gone:
            return
        if self.loop.time() < self._deadline:  # moved on since the timer was set: wait again
            self._timer = self.loop.call_at(self._deadline, self._expire)
            return
        if self._waiting == _IDLE:
            self.close()
            return
        what = "head" if self._waiting == _HEAD else "body"
        self.server.note("http_slow_clients", self.peer, f"the request's {what} arrived too slowly")
        self._refuse(408, f"the request's {what} did not arrive in time", counted=True)

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=SEND_BUFFER)  # type: ignore[attr-defined]
        self._socket = transport.get_extra_info("socket")
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) else str(peer or "")
        server = self.server
        if len(server._connections) >= self.limits.max_connections:
            self.refused = True
            server.note("http_refused_connections", self.peer, "over max_connections")
            resp = server.error_body(503, "the server has as many connections as it takes: retry later")
            resp.headers["Retry-After"] = str(self.limits.retry_after_s)
            self._send(resp, keep_alive=False)
            self._close_soon()
            return
        server._connections.add(self)
        self._arm(_IDLE, self.limits.idle_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # discarded until the linger ends
        if self._task is not None:  # a request is being answered: the rest waits, unparsed
            self._stash += data
            self._pause()
            return
        idle = not self._in_message
        in_head = idle or not self._head_done
        self._begun = 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, _Stop):
                self._overflow = True
                self._pause()
            elif isinstance(cause, _Refusal):
                self._refuse(cause.status, cause.message, cause.counter, cause.response)
                return
            else:  # a callback of ours failed: a defect, logged; the client gets a 400
                log.error("http1.parser_callback_failed", exc_info=cause)
                self._refuse(400, "bad HTTP request")
                return
        except httptools.HttpParserUpgrade:
            self._refuse(400, "bad HTTP request: protocol upgrades are not served")
            return
        except httptools.HttpParserError:
            self._refuse(400, "bad HTTP request: malformed or ambiguous (the connection is closed)")
            return
        if self._in_message and not self._head_done and in_head and self._begun <= idle:
            # the read was all this head's (it began before the read, or the read began with it):
            # its unparsed part (a header httptools still gathers) counts as well
            self._head_read += len(data)
            if self._head_read > self.limits.max_head_bytes:
                self._refuse(*self._too_large_head())
                return
        if self._queue and self._task is None:
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.server._connections.discard(self)
        self.server._lingering.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._sent_timer is not None:
            self._sent_timer.cancel()
            self._sent_timer = None
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
        if len(self._queue) >= self.limits.max_pipelined:
            raise _Stop
        self._begun += 1
        self._in_message, self._head_done = True, False
        self._url, self._url_size, self._headers, self._body, self._size = [], 0, {}, [], 0
        self._head_size, self._head_read, self._n_headers = 0, 0, 0  # _head_size: set by on_url
        if self._task is None and not self._queue:  # reading, not answering: the head's deadline runs
            self._arm(_HEAD, self.limits.head_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._url_size += len(url)
        # "METHOD SP url SP HTTP/1.1 CRLF", and the CRLF that ends the head
        self._head_size = len(self.parser.get_method()) + self._url_size + 14
        if self._head_size > self.limits.max_head_bytes:
            raise _Refusal(414, f"the request line is longer than {self.limits.max_head_bytes - 2} bytes")
        self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._n_headers += 1
        self._head_size += len(name) + len(value) + 4  # "name: value CRLF"
        if self._n_headers > self.limits.max_headers or self._head_size > self.limits.max_head_bytes:
            raise _Refusal(*self._too_large_head())
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def _too_large_head(self) -> tuple[int, str]:
        lim = self.limits
        if self._n_headers > lim.max_headers:
            return 431, f"the request has more than {lim.max_headers} headers"
        return 431, f"the request's line and headers are larger than {lim.max_head_bytes} bytes"

    def on_headers_complete(self) -> None:
        self._head_done = True
        lim, headers, parser = self.limits, self._headers, self.parser
        method = parser.get_method().decode()
        if parser.get_http_version() not in ("1.1", "1.0"):
            raise _Refusal(505, "only HTTP/1.1 and HTTP/1.0 are served")
        coding = headers.get("transfer-encoding")
        if coding is not None and coding.strip().lower() != "chunked":
            raise _Refusal(501, "the only transfer coding of a request served is chunked")
        path, _, query = b"".join(self._url).decode("latin-1").partition("?")
        self._req = Request(method, path, query, headers, b"", self)
        if self.server.gate is not None and (refusal := self.server.gate(self._req)) is not None:
            raise _Refusal(
                refusal.status, "refused", "http_unauthorized" if refusal.status == 401 else "", refusal
            )
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > lim.max_body_bytes:
            raise _Refusal(413, f"the request body is larger than {lim.max_body_bytes} bytes")
        if headers.get("expect", "").lower() == "100-continue":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if coding is not None or (length.isdigit() and int(length)):  # a body follows
            self._body_start = self.loop.time()
            expected = int(length) if coding is None else 0
            self._deadline_body(expected)

    def _deadline_body(self, received: int) -> None:
        if self._task is None and not self._queue:
            lim = self.limits
            delay = self._body_start + lim.body_timeout_s + received / lim.body_min_rate - self.loop.time()
            self._arm(_BODY, delay)

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.limits.max_body_bytes:
            raise _Refusal(413, f"the request body is larger than {self.limits.max_body_bytes} bytes")
        self._body.append(body)
        if "transfer-encoding" in self._headers:  # a chunked body's deadline grows as it arrives
            self._deadline_body(self._size)

    def on_message_complete(self) -> None:
        req = self._req
        assert req is not None
        self._req, self._in_message, self._waiting = None, False, 0
        req.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        self._queue.append((req, self.parser.should_keep_alive(), self.parser.get_http_version() == "1.0"))

    # -- answering ---------------------------------------------------------------------------

    def _pause(self) -> None:
        if not self._paused_reading and self.transport is not None and not self.transport.is_closing():
            self._paused_reading = True
            self.transport.pause_reading()

    def _next(self) -> None:
        req, keep_alive, self._http10 = self._queue.popleft()
        self._waiting = 0
        self._task = self.loop.create_task(self._answer(req, keep_alive))

    async def _answer(self, req: Request, keep_alive: bool) -> None:
        keep_alive = keep_alive and not self._http10 and not (self._overflow and not self._queue)
        try:
            resp = await self.server.handler(req)
        except Exception:  # a handler's bug: a 500 with an id, the server serves on
            error_id = secrets.token_hex(6)
            log.exception("http1.handler_error", path=req.path, error_id=error_id)
            resp = None if self._streaming else self.server.error_body(500, internal_error(error_id))
        if self._streaming is not None:
            with contextlib.suppress(ConnectionError):
                await self._streaming.end()
            keep_alive = keep_alive and self._streaming._chunked
            self._streaming = None
        elif resp is not None:
            with contextlib.suppress(ConnectionError):
                self._send(resp, keep_alive)
                if keep_alive and self._drained is not None and not self._drained.done():
                    # past the high-water mark: the next request waits, unparsed, until the client
                    # takes this answer (or send_timeout_s resets it), as a stream's writer waits
                    await self.drain()
        self._task = None
        if not keep_alive:
            self.close()
        elif self._queue:
            self._next()
        elif not self.gone:
            stash, self._stash = self._stash, b""
            if self._paused_reading and self.transport is not None:
                self._paused_reading = False
                self.transport.resume_reading()
            if self._in_message:  # a request begun in the read of the last: its deadline runs now
                if self._head_done:
                    self._body_start = self.loop.time()
                    self._deadline_body(self._size)
                else:
                    self._arm(_HEAD, self.limits.head_timeout_s)
            else:
                self._arm(_IDLE, self.limits.idle_timeout_s)
            if stash:
                self.data_received(stash)

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
        self._written += len(data)
        if self._sent_timer is None and self.transport.get_write_buffer_size():
            # the kernel's buffer is full: from now on the client must keep taking bytes
            self._delivered, self._delivered_at = self._taken(), self.loop.time()
            self._sent_timer = self.loop.call_later(
                self.limits.send_timeout_s / _SEND_CHECKS, self._check_sent
            )

    def _taken(self) -> int:
        """The bytes of the answers the client has taken: written, less what the transport holds and
        what the kernel holds unacknowledged (with a kernel buffer of megabytes, a client reading
        slowly but steadily takes bytes long before the transport's buffer shrinks)."""
        assert self.transport is not None
        held = self.transport.get_write_buffer_size()
        fd = self._socket.fileno() if self._socket is not None else -1
        if _OUTQ is not None and fd >= 0:
            with contextlib.suppress(OSError):
                held += struct.unpack("i", fcntl.ioctl(fd, _OUTQ, b"\0\0\0\0"))[0]
        return self._written - held

    def _check_sent(self) -> None:
        """While the transport holds bytes: the client took some since the last check, or it has
        taken none for send_timeout_s and its connection is reset (closing it would wait for ever
        for the buffer to be sent)."""
        self._sent_timer = None
        t = self.transport
        if self.gone or t is None or not t.get_write_buffer_size():
            return  # gone, or all handed to the kernel: the next write the kernel cannot take re-arms it
        now, taken = self.loop.time(), self._taken()
        if taken != self._delivered:
            self._delivered, self._delivered_at = taken, now
        elif now - self._delivered_at >= self.limits.send_timeout_s:
            timeout = self.limits.send_timeout_s
            self.server.note("http_stalled_readers", self.peer, f"took nothing of its answer for {timeout} s")
            if self._socket is not None:  # a reset: the kernel drops what it holds, rather than
                with contextlib.suppress(OSError):  # keep trying to send it once the socket is closed
                    self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            t.abort()
            return
        self._sent_timer = self.loop.call_later(self.limits.send_timeout_s / _SEND_CHECKS, self._check_sent)

    async def drain(self) -> None:
        if self._drained is not None and not self._drained.done():
            await self._drained
        if self.gone:
            raise ConnectionResetError("the client closed the connection")

    def _refuse(
        self,
        status: int,
        message: str,
        counter: str = "http_bad_requests",
        response: Response | None = None,
        counted: bool = False,
    ) -> None:
        """Answer a request the server will not take, and close: its bytes cannot be skipped (nor,
        for one refused by its head, read)."""
        self._queue.clear()
        self._waiting = 0
        if not counted and counter:
            self.server.note(counter, self.peer, f"{status}: {message}")
        with contextlib.suppress(ConnectionError):
            if self._task is None and self._streaming is None:
                self._send(response or self.server.error_body(status, message), keep_alive=False)
        self._close_soon()

    def _close_soon(self) -> None:
        """Close once the answer written has had time to be read, reading nothing more: closed at
        once with unread bytes, the connection would be reset, and its client might lose the answer."""
        t = self.transport
        if t is None or t.is_closing():
            return
        if len(self.server._lingering) >= _LINGERING:
            self.close()
            return
        self.server._lingering.add(self)
        self._waiting = 0
        self._pause()
        with contextlib.suppress(OSError, NotImplementedError, RuntimeError):
            t.write_eof()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(_LINGER_S, self.close)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


def internal_error(error_id: str) -> str:
    """A 500's message: no exception text, the id the server's log line carries."""
    return f"internal error (error_id {error_id}): the server's log has its details"


class HTTPServer:
    """Serves ``handler`` (a request in, a :class:`Response` out, or ``None`` after streaming)
    within ``limits``; ``error_body`` shapes the answers the server gives itself (bad HTTP, a
    request over a limit, a handler that raised); ``gate`` sees each request's head before its body
    is read (a :class:`Response` refuses it, and closes the connection). ``counters`` (given or
    made) counts the refusals (:data:`COUNTERS`)."""

    def __init__(
        self,
        handler: Handler,
        error_body: ErrorBody,
        limits: HTTPLimits | None = None,
        gate: Gate | None = None,
        counters: dict[str, int] | None = None,
    ) -> None:
        self.handler, self.error_body, self.gate = handler, error_body, gate
        self.limits = limits or HTTPLimits()
        self.counters = counters if counters is not None else {}
        for key in COUNTERS:
            self.counters.setdefault(key, 0)
        self._listener: socket.socket | None = None
        self._adopting: set[asyncio.Task[None]] = set()
        self._connections: set[_Connection] = set()
        self._lingering: set[_Connection] = set()
        self._noted: dict[str, float] = {}  # peer -> when its last refusal was logged
        self._loop: asyncio.AbstractEventLoop

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port.

        The server accepts by itself, up to :data:`ACCEPT_BATCH` connections each time the
        listening socket is ready: uvloop (libuv) accepts one per turn of the loop, so a busy loop
        (a turn of hundreds of milliseconds) left a burst of new clients in the listen queue for
        seconds, one turn each (bench/RESULTS.md, "Load held")."""
        self._loop = asyncio.get_running_loop()
        _room_for(self.limits.max_connections + _LINGERING + _FD_SPARE)
        family = (await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0][0]
        sock = socket.create_server((host, port), family=family, backlog=self.limits.backlog)
        sock.setblocking(False)
        self._listener = sock
        self._loop.add_reader(sock.fileno(), self._accept)
        return int(sock.getsockname()[1])

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # the client gave up while it waited in the queue
                continue
            except OSError as e:  # out of descriptors or memory: wait, as asyncio's servers do
                log.warning("http1.accept_failed", error=repr(e), retry_in_s=ACCEPT_RETRY_S)
                self._loop.remove_reader(self._listener.fileno())
                self._loop.call_later(ACCEPT_RETRY_S, self._resume_accepting)
                return
            task = self._loop.create_task(self._adopt(conn))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    def _resume_accepting(self) -> None:
        if self._listener is not None:
            self._loop.add_reader(self._listener.fileno(), self._accept)

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(lambda: _Connection(self), conn)
        except OSError:  # gone before its transport was made
            conn.close()
        except BaseException:  # the server closing: the socket is not the transport's yet
            conn.close()
            raise

    def note(self, counter: str, peer: str, why: str) -> None:
        """Count a refusal; log it unless this peer's last was logged under LOG_EVERY_S ago."""
        if counter:
            self.counters[counter] = self.counters.get(counter, 0) + 1
        now = self._loop.time()
        if now - self._noted.get(peer, -LOG_EVERY_S) < LOG_EVERY_S:
            return
        if len(self._noted) >= 4096:  # forget the peers not logged within the minute
            self._noted = {p: t for p, t in self._noted.items() if now - t < LOG_EVERY_S}
        self._noted[peer] = now
        log.warning(
            "http1.refused",
            peer=peer,
            why=why,
            counter=counter,
            note=f"further refusals of this peer are counted, not logged, for {LOG_EVERY_S:.0f} s",
        )

    async def aclose(self) -> None:
        """Stop listening, drop every connection, cancel the answers in progress."""
        if self._listener is None:
            return
        self._loop.remove_reader(self._listener.fileno())
        self._listener.close()
        self._listener = None
        for task in list(self._adopting):
            task.cancel()
        tasks: list[Any] = [c._task for c in self._connections if c._task is not None]
        for c in [*self._connections, *self._lingering]:
            c.close()
            if c.transport is not None and c.transport.get_write_buffer_size():
                c.transport.abort()  # its client is not reading: closing would wait for it
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, *self._adopting, return_exceptions=True)


def _room_for(files: int) -> None:
    """Raise this process's soft limit on open files to ``files`` if it is lower (up to the hard
    limit): each connection is one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < files:
        want = files if hard == resource.RLIM_INFINITY else min(files, hard)
        if want > soft:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
