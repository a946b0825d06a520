"""nodes/rollout/http1/server.py on real sockets, the endpoint's server: keep-alive and
pipelining in order, chunked and oversized bodies, 100-continue, malformed HTTP, handler failures,
streamed answers with back-pressure and clients that leave, HTTP/1.0, shutdown."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator

import httpx
import pytest

from nodes.rollout.http1 import HTTPLimits, HTTPServer, Request, Response
from rlactors.base.aio import wait_for

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
    server = HTTPServer(app, error_body, HTTPLimits(max_body_bytes=1000))
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
    writer.write(
        b"POST /slow?a=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
        b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n"
    )
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
        assert r.status_code == 500 and r.text.startswith("error 500: internal error (error_id ")
        assert "broken" not in r.text and "ValueError" not in r.text  # no exception text
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


def test_a_burst_of_new_connections_is_accepted_in_one_turn_of_the_loop() -> None:
    """Connections that waited in the listen queue while the loop was busy are all taken in the
    loop's next turns, not one per turn (uvloop's own accept, on the loop a rollout actor runs): a
    busy loop's turn can take hundreds of milliseconds, and the fiftieth client would wait fifty of
    them."""
    import uvloop

    uvloop.run(_burst())


async def _burst() -> None:

    async def app(req: Request) -> Response:
        return Response(200, b"ok", "text/plain")

    server = HTTPServer(app, lambda status, message: Response(status, message.encode(), "text/plain"))
    port = await server.start("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []

    def connect() -> None:  # the kernel completes each handshake; the loop is held meanwhile
        for _ in range(50):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=30))

    try:
        clients = threading.Thread(target=connect)
        clients.start()
        clients.join()  # holds the loop: all 50 wait in the listen queue
        turns = 0

        def turn() -> None:  # once per turn of the loop, until all are accepted
            nonlocal turns
            turns += 1
            if len(server._connections) < 50:
                loop.call_soon(turn)

        loop.call_soon(turn)
        await wait_for(_accepted(server, 50), 30)
        assert turns <= 5, f"{turns} turns of the loop to accept 50 waiting connections"
    finally:
        for sock in socks:
            sock.close()
        await server.aclose()


async def _accepted(server: HTTPServer, n: int) -> None:
    while len(server._connections) < n:  # noqa: ASYNC110 (counting the loop's turns: no event)
        await asyncio.sleep(0)
