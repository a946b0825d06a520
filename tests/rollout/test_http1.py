"""nodes/rollout/http1.py on real sockets. The endpoint's server: keep-alive and pipelining in
order, chunked and oversized bodies, 100-continue, malformed HTTP, handler failures, streamed
answers with back-pressure and clients that leave, HTTP/1.0, shutdown. The rollout client's
connection pools: reuse up to a cap, keep-alive expiry, timeouts, refused/closed/garbled answers,
event streams line by line, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from nodes.rollout.http1 import ClientError, ClientPool, HTTPServer, Request, Response
from rlactors.aio import wait_for

HOST = "127.0.0.1"


class App:
    """Echoes the method, path and body; ``/slow`` waits first, ``/fail`` raises, ``/stream``
    streams ``n`` chunks, waiting on ``gate`` before each once it is set."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.stream_error: BaseException | None = None
        self.stream_done = asyncio.Event()
        self.gate: asyncio.Event | None = None
        self.hanging, self.cancelled = asyncio.Event(), asyncio.Event()

    async def __call__(self, req: Request) -> Response | None:
        self.seen.append(req.path)
        if req.path == "/slow":
            await asyncio.sleep(0.2)
        if req.path == "/hang":
            self.hanging.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if req.path == "/fail":
            raise ValueError("broken handler")
        if req.path == "/stream":
            out = await req.stream(200, {"Content-Type": "text/event-stream"})
            try:
                for i in range(int(req.query.removeprefix("n="))):
                    if self.gate is not None:
                        await self.gate.wait()
                    await out.write(b"data: %d %s\n\n" % (i, b"x" * 1000))
            except ConnectionError as e:
                self.stream_error = e
            finally:
                self.stream_done.set()
            return None
        body = f"{req.method} {req.path}?{req.query} {req.body.decode()}".encode()
        return Response(200, body, "text/plain", {"X-Test": "yes"})


def error_body(status: int, message: str) -> Response:
    return Response(status, f"error {status}: {message}".encode(), "text/plain")


@pytest.fixture
async def served() -> AsyncIterator[tuple[App, HTTPServer, int]]:
    app = App()
    server = HTTPServer(app, error_body, max_body=1000)
    port = await server.start(HOST, 0)
    try:
        yield app, server, port
    finally:
        await server.aclose()


async def read_answer(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    """One whole answer with a Content-Length: (status line, headers, body)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in head[1:] if line)
    return head[0], headers, await reader.readexactly(int(headers["Content-Length"]))


async def test_keep_alive_and_pipelined_requests_are_answered_in_order(
    served: tuple[App, HTTPServer, int],
) -> None:
    app, _, port = served
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(b"POST /slow?a=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                 b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")  # fmt: skip
    first, second = await read_answer(reader), await read_answer(reader)
    assert first[0] == "HTTP/1.1 200 OK" and first[2] == b"POST /slow?a=1 abc" and first[1]["X-Test"] == "yes"
    assert second[2] == b"GET /fast? "  # the fast one waited for the slow one's answer
    writer.write(b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection, kept alive
    assert (await read_answer(reader))[2] == b"GET /again? "
    assert app.seen == ["/slow", "/fast", "/again"]
    writer.close()


async def test_chunked_body_and_100_continue(served: tuple[App, HTTPServer, int]) -> None:
    _, _, port = served
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(
        b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    assert (await read_answer(reader))[2] == b"POST /c? abcde"
    writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"  # before the body is sent
    writer.write(b"hi")
    assert (await read_answer(reader))[2] == b"POST /e? hi"
    writer.close()


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n", 413),
        (b"POST /big HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3e9\r\n" + b"x" * 1001, 413),
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: abc\r\n\r\n", 400),
    ],
)
async def test_bad_requests_are_refused_and_the_server_keeps_serving(
    served: tuple[App, HTTPServer, int], request_bytes: bytes, status: int
) -> None:
    app, _, port = served
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(request_bytes)
    line, headers, body = await read_answer(reader)
    assert line.startswith(f"HTTP/1.1 {status} ") and body.startswith(f"error {status}: ".encode())
    assert (
        headers["Connection"] == "close" and await reader.read() == b""
    )  # closed: its bytes cannot be skipped
    writer.close()
    assert app.seen == []
    async with httpx.AsyncClient() as http:
        assert (await http.post(f"http://{HOST}:{port}/ok", content=b"x" * 1000)).status_code == 200


async def test_a_failing_handler_answers_500_and_the_connection_goes_on(
    served: tuple[App, HTTPServer, int],
) -> None:
    _, _, port = served
    async with httpx.AsyncClient() as http:
        r = await http.get(f"http://{HOST}:{port}/fail")
        assert r.status_code == 500 and r.text == "error 500: ValueError: broken handler"
        assert (await http.get(f"http://{HOST}:{port}/next")).text == "GET /next? "


async def test_a_streamed_answer_arrives_in_chunks(served: tuple[App, HTTPServer, int]) -> None:
    _, _, port = served
    async with httpx.AsyncClient() as http, http.stream("GET", f"http://{HOST}:{port}/stream?n=50") as r:
        assert (
            r.headers["transfer-encoding"] == "chunked" and r.headers["content-type"] == "text/event-stream"
        )
        lines = [line async for line in r.aiter_lines() if line]
    assert [int(line.split()[1]) for line in lines] == list(range(50))
    async with httpx.AsyncClient() as http:  # the connection went back to serving after the last chunk
        assert (await http.get(f"http://{HOST}:{port}/after")).status_code == 200


async def test_a_client_that_leaves_mid_stream_ends_the_writes(served: tuple[App, HTTPServer, int]) -> None:
    app, _, port = served
    app.gate = asyncio.Event()
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(b"GET /stream?n=100000 HTTP/1.1\r\nHost: x\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")
    writer.transport.abort()  # gone without reading: the writes fill the buffer, then fail
    app.gate.set()
    await wait_for(app.stream_done.wait(), 10)
    assert isinstance(app.stream_error, ConnectionError)


async def test_back_pressure_waits_for_a_slow_reader(served: tuple[App, HTTPServer, int]) -> None:
    app, _, port = served
    _, writer = await asyncio.open_connection(HOST, port, limit=1 << 24)
    writer.transport.pause_reading()  # type: ignore[attr-defined]
    writer.write(b"GET /stream?n=20000 HTTP/1.1\r\nHost: x\r\n\r\n")  # ~20 MB: more than the socket buffers
    with pytest.raises(TimeoutError):
        await wait_for(asyncio.shield(app.stream_done.wait()), 0.5)  # the handler waits on the reader
    writer.transport.resume_reading()  # type: ignore[attr-defined]
    await wait_for(app.stream_done.wait(), 20)
    assert app.stream_error is None
    writer.close()


async def test_http_10_gets_no_chunks_and_no_keep_alive(served: tuple[App, HTTPServer, int]) -> None:
    _, _, port = served
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(b"GET /stream?n=2 HTTP/1.0\r\n\r\n")
    answer = await reader.read()  # the server closes the connection at the end
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Connection: close" in head and b"chunked" not in head
    assert body == b"data: 0 " + b"x" * 1000 + b"\n\ndata: 1 " + b"x" * 1000 + b"\n\n"
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(b"GET /plain HTTP/1.0\r\n\r\n")
    assert (await reader.read()).endswith(b"\r\n\r\nGET /plain? ")
    writer.close()


async def test_aclose_cancels_answers_in_progress_and_closes_connections(
    served: tuple[App, HTTPServer, int],
) -> None:
    app, server, port = served
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
    await wait_for(app.hanging.wait(), 10)
    await server.aclose()
    assert app.cancelled.is_set() and await reader.read() == b""
    with pytest.raises(OSError):
        await asyncio.open_connection(HOST, port)


# -- the client's connection pools -----------------------------------------------------------------


def pool(port: int, **kw: float) -> ClientPool:
    args = {"max_connections": 8, "keepalive_s": 4.0, "connect_timeout_s": 5.0, **kw}
    return ClientPool(HOST, port, **args)  # type: ignore[arg-type]


class Counting:
    """A raw server that counts connections and answers each request with ``reply(request)``."""

    def __init__(self, reply: Callable[[bytes], Awaitable[bytes | None]]) -> None:
        self.reply, self.connections, self.open, self.most_open = reply, 0, 0, 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                answer = await self.reply(head + await reader.readexactly(length))
                if answer is None:
                    break
                writer.write(answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


@contextlib.asynccontextmanager
async def raw_server(handler: Counting) -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, HOST, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_the_pool_reuses_connections_up_to_its_cap(served: tuple[App, HTTPServer, int]) -> None:
    async def slow(request: bytes) -> bytes:
        await asyncio.sleep(0.05)
        return ok(request.split(b"\r\n\r\n", 1)[1])

    counting = Counting(slow)
    async with raw_server(counting) as port:
        p = pool(port, max_connections=2)
        answers = await asyncio.gather(
            *(p.request("POST", "/x", b"%d" % i, {"A": "b"}, 10) for i in range(10))
        )
        assert answers == [(200, b"%d" % i) for i in range(10)]
        assert counting.connections == 2 and counting.most_open == 2  # 10 requests, 2 connections
        p.close()


async def test_an_idle_connection_past_keepalive_is_not_reused() -> None:
    async def echo(request: bytes) -> bytes:
        return ok(b"hi")

    counting = Counting(echo)
    async with raw_server(counting) as port:
        p = pool(port, keepalive_s=0.05)
        assert await p.request("POST", "/", b"", {}, 5) == (200, b"hi")
        assert await p.request("POST", "/", b"", {}, 5) == (200, b"hi")
        assert counting.connections == 1
        await asyncio.sleep(0.1)  # past keepalive_s (a timer the test waits out, not a synchronisation)
        assert await p.request("POST", "/", b"", {}, 5) == (200, b"hi")
        assert counting.connections == 2
        p.close()


async def test_no_answer_in_time_is_a_timeout_that_may_still_run_and_frees_the_slot() -> None:
    gate = asyncio.Event()

    async def hang(request: bytes) -> bytes:
        if b"/hang" in request:
            await gate.wait()
        return ok(b"late" if b"/hang" in request else b"fine")

    async with raw_server(Counting(hang)) as port:
        p = pool(port, max_connections=1)
        with pytest.raises(ClientError) as e:
            await p.request("POST", "/hang", b"", {}, 0.2)
        assert e.value.timed_out  # it reached the server: abort it there
        assert await p.request("POST", "/next", b"", {}, 5) == (
            200,
            b"fine",
        )  # a new connection, not the late answer
        gate.set()
        p.close()


async def test_refused_closed_and_garbled_answers_are_client_errors() -> None:
    listener = await asyncio.start_server(lambda r, w: None, HOST, 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    with pytest.raises(ClientError) as e:
        await pool(port).request("POST", "/", b"", {}, 5)
    assert not e.value.timed_out and "connect to" in str(e.value)

    async def close(request: bytes) -> None:
        return None

    async def garble(request: bytes) -> bytes:
        return b"HTTP/1.1 2x0 WHAT\r\n\r\n"

    for reply in (close, garble):
        async with raw_server(Counting(reply)) as port:
            p = pool(port)
            with pytest.raises(ClientError) as e:
                await p.request("POST", "/", b"", {}, 5)
            assert not e.value.timed_out
            p.close()


async def test_an_event_stream_hands_over_whole_lines_as_they_arrive() -> None:
    got: list[bytes] = []
    sent = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for piece in (b"data: one\n\nda", b"ta: t", b"wo\n\n", b"data: " + b"x" * 300_000 + b"\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            if piece == b"data: one\n\nda":
                await sent.wait()  # the first line reached the client before the rest was sent
        writer.write(b"0\r\n\r\n")

    def on_line(line: bytes) -> None:
        got.append(line)
        sent.set()

    server = await asyncio.start_server(handler, HOST, 0)
    p = pool(server.sockets[0].getsockname()[1])
    assert await p.request("POST", "/generate", b"{}", {}, 10, on_line) == (200, b"")
    assert got == [b"data: one", b"", b"data: two", b"", b"data: " + b"x" * 300_000, b""]
    p.close()
    server.close()


async def test_an_error_answer_to_a_stream_comes_back_whole(served: tuple[App, HTTPServer, int]) -> None:
    _, _, port = served
    p = pool(port)
    lines: list[bytes] = []
    assert await p.request("POST", "/fail", b"", {}, 5, lines.append) == (
        500,
        b"error 500: ValueError: broken handler",
    )
    assert lines == []
    p.close()


async def test_a_cancelled_request_gives_its_slot_back() -> None:
    gate, hanging = asyncio.Event(), asyncio.Event()

    async def hang(request: bytes) -> bytes:
        if b"/hang" in request:
            hanging.set()
            await gate.wait()
        return ok(b"fine")

    async with raw_server(Counting(hang)) as port:
        p = pool(port, max_connections=1)
        stuck = asyncio.ensure_future(p.request("POST", "/hang", b"", {}, None))
        waiting = asyncio.ensure_future(
            p.request("POST", "/w", b"", {}, None)
        )  # waits for the one connection
        await wait_for(hanging.wait(), 5)
        await asyncio.sleep(0)  # one loop turn: the second request's first step queues it
        assert len(p._waiters) == 1 and not waiting.done()
        stuck.cancel()
        assert await wait_for(waiting, 5) == (200, b"fine")
        gate.set()
        p.close()


async def test_an_informational_answer_is_skipped_for_the_real_one() -> None:
    async def early(request: bytes) -> bytes:
        return b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + ok(b"real")

    async with raw_server(Counting(early)) as port:
        p = pool(port)
        assert await p.request("POST", "/", b"", {}, 5) == (200, b"real")
        assert await p.request("POST", "/", b"", {}, 5) == (200, b"real")  # and the connection goes on
        p.close()
