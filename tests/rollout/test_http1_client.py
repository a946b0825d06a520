"""nodes/rollout/http1/client.py's connection pools on real sockets, against raw servers that
write exact bytes: reuse up to a cap, keep-alive expiry, timeouts, refused/closed/garbled answers,
event streams line by line, cancellation, TLS; and the protocol's edges: chunked bodies and
trailers, keep-alive and what ends it, 1xx answers, Content-Length mismatches, a server closing
mid-body or answering what was not asked, upgrades, answers split at every byte. (The fuzz of
answers is tests/rollout/test_http1_fuzz.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from nodes.rollout.http1 import ClientError, ClientPool
from rlactors.base.aio import wait_for

HOST = "127.0.0.1"


def pool(port: int, **kw: Any) -> ClientPool:
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


async def test_the_pool_reuses_connections_up_to_its_cap() -> None:
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


async def test_an_error_answer_to_a_stream_comes_back_whole() -> None:
    async def fail(request: bytes) -> bytes:
        return (
            b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\nContent-Length: 4\r\n\r\nfail"
        )

    async with raw_server(Counting(fail)) as port:
        p = pool(port)
        lines: list[bytes] = []
        assert await p.request("POST", "/generate", b"", {}, 5, lines.append) == (500, b"fail")
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


# -- the protocol's edges ---------------------------------------------------------------------------


class Scripted:
    """A raw server that answers the n-th request it reads (on any connection) with ``answers[n]``,
    written as is, and closes that connection after it when the answer ends with ``CLOSE``."""

    def __init__(self, *answers: bytes) -> None:
        self.answers, self.served, self.connections = list(answers), 0, 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
                answer = self.answers[self.served]
                self.served += 1
                writer.write(answer.removesuffix(CLOSE))
                await writer.drain()
                if answer.endswith(CLOSE):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


CLOSE = b"<close>"


@contextlib.asynccontextmanager
async def scripted(*answers: bytes) -> AsyncIterator[tuple[ClientPool, Scripted]]:
    server = Scripted(*answers)
    listener = await asyncio.start_server(server, HOST, 0)
    p = pool(listener.sockets[0].getsockname()[1])
    try:
        yield p, server
    finally:
        p.close()
        listener.close()


async def ask(p: ClientPool, lines: list[bytes] | None = None) -> tuple[int, bytes]:
    """One request; a wait bounded here so that a client that hangs fails the test, not stalls it."""
    return await wait_for(
        p.request("POST", "/", b"{}", {}, None, None if lines is None else lines.append), 10
    )


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\n\r\n"
    b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Sum: 5\r\nContent-Type: text/event-stream\r\n\r\n"
)


async def test_chunked_bodies_with_extensions_and_trailers_and_the_connection_goes_on() -> None:
    async with scripted(CHUNKED, ok(b"next")) as (p, server):
        assert await ask(p) == (200, b"abcde")  # the trailer names no body and changes nothing
        assert await ask(p) == (200, b"next") and server.connections == 1


@pytest.mark.parametrize(
    "first, reused",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi", True),
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n", True),  # 204: no body, whatever it says
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi" + CLOSE, False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi" + CLOSE, False),  # 1.0: closes unless it says
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nhi", True),
    ],
)
async def test_keep_alive_is_what_the_answer_says(first: bytes, reused: bool) -> None:
    async with scripted(first, ok(b"second")) as (p, server):
        status, body = await ask(p)
        assert (status, body) in ((200, b"hi"), (204, b""))
        assert await ask(p) == (200, b"second")
        assert server.connections == (1 if reused else 2)


async def test_a_body_without_length_or_chunks_ends_when_the_server_closes() -> None:
    async with scripted(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello, world" + CLOSE) as (p, _):
        assert await ask(p) == (200, b"hello, world")
    stream = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\ndata: 2" + CLOSE
    async with scripted(stream) as (p, _):
        lines: list[bytes] = []
        assert await ask(p, lines) == (200, b"")
        assert lines == [b"data: 1", b"", b"data: 2"]


async def test_informational_answers_are_skipped_however_many() -> None:
    early = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    async with scripted(early + ok(b"real"), early + CHUNKED) as (p, server):
        assert await ask(p) == (200, b"real")
        assert await ask(p) == (200, b"abcde") and server.connections == 1


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort" + CLOSE,  # fewer bytes than it said
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab" + CLOSE,  # closed mid-chunk
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n" + CLOSE,  # before the last chunk
        b"HTTP/1.1 200 OK\r\nContent-Le" + CLOSE,  # mid-headers
        b"HTTP/1.1 2" + CLOSE,  # mid-status line
        CLOSE,  # no answer at all
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",  # two lengths
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",  # a bad chunk size
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n\x81\x00",
        b"SSH-2.0-OpenSSH_9.6\r\n",  # not HTTP
    ],
    ids=["short-body", "mid-chunk", "no-last-chunk", "mid-headers", "mid-status", "nothing",
         "two-lengths", "length-and-chunks", "negative-length", "bad-chunk-size", "upgrade", "not-http"],
)  # fmt: skip
async def test_a_cut_or_malformed_answer_is_a_client_error_at_once_and_the_pool_goes_on(
    answer: bytes,
) -> None:
    async with scripted(answer, ok(b"fine")) as (p, server):
        with pytest.raises(ClientError) as e:
            await ask(p)
        assert not e.value.timed_out  # the answer came (or the connection went): not a timeout
        assert await ask(p) == (200, b"fine") and server.connections == 2


async def test_a_stream_cut_mid_body_hands_over_its_lines_then_fails() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    part = b"data: 1\n\ndata: 2\n\nda"
    async with scripted(head + b"%x\r\n%s\r\n" % (len(part), part) + CLOSE) as (p, _):
        lines: list[bytes] = []
        with pytest.raises(ClientError):
            await ask(p, lines)
        assert lines == [b"data: 1", b"", b"data: 2", b""]  # whole lines only: not the cut "da"


async def test_bytes_after_an_answer_never_answer_the_next_request() -> None:
    stray = ok(b"asked") + ok(b"not asked")  # one request, two answers (longer than its length said)
    async with scripted(stray, ok(b"second")) as (p, server):
        assert await ask(p) == (200, b"asked")
        assert await ask(p) == (200, b"second") and server.connections == 2
    long = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nabcdef"
    async with scripted(long, ok(b"second")) as (p, server):
        assert await ask(p) == (200, b"ab")
        assert await ask(p) == (200, b"second") and server.connections == 2


async def test_bytes_on_an_idle_connection_close_it() -> None:
    """A server that says something while no request is out (uvicorn's 408 before closing an idle
    connection, say): the client closes that connection, and the next request goes on a new one
    and gets its own answer."""
    answered, client_left = asyncio.Event(), asyncio.Event()
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
        writer.write(ok(b"answer %d" % connections))
        if connections == 1:
            await answered.wait()  # the client has its answer: the connection is idle in the pool
            writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
            await reader.read()  # EOF: the client closed the connection
            client_left.set()
        writer.close()

    listener = await asyncio.start_server(handler, HOST, 0)
    p = pool(listener.sockets[0].getsockname()[1])
    assert await ask(p) == (200, b"answer 1")
    answered.set()
    await wait_for(client_left.wait(), 5)
    assert await ask(p) == (200, b"answer 2")
    p.close()
    listener.close()


async def test_an_answer_written_a_byte_at_a_time_reads_the_same() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\n" + CHUNKED

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
        writer.transport.set_write_buffer_limits(0)  # type: ignore[attr-defined]
        for i in range(len(answer)):
            writer.write(answer[i : i + 1])
            await writer.drain()
        await reader.read()
        writer.close()

    listener = await asyncio.start_server(handler, HOST, 0)
    p = pool(listener.sockets[0].getsockname()[1])
    assert await ask(p) == (200, b"abcde")
    p.close()
    listener.close()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (openssl's command line): (cert, key) paths."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_tls_answers_and_an_untrusted_certificate_is_a_client_error(
    certificate: tuple[str, str],
) -> None:
    cert, key = certificate
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    counting = Counting(lambda request: _ok_soon(b"secret"))
    listener = await asyncio.start_server(counting, HOST, 0, ssl=served)
    port = listener.sockets[0].getsockname()[1]
    trusted = ssl.create_default_context(cafile=cert)
    p = pool(port, ssl=trusted)
    assert await ask(p) == (200, b"secret") and await ask(p) == (200, b"secret")
    assert counting.connections == 1  # kept alive over TLS too
    p.close()
    p = pool(port, ssl=ssl.create_default_context())  # the system CAs only
    with pytest.raises(ClientError, match="CERTIFICATE_VERIFY_FAILED") as e:
        await ask(p)
    assert not e.value.timed_out
    p.close()
    listener.close()


async def _ok_soon(body: bytes) -> bytes:
    return ok(body)
