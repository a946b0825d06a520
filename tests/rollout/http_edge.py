"""The protocol-edge checks of an HTTP server that faces the outside (nodes/rollout/http1/server.py's
HTTPLimits), on raw sockets: each bound at its edge (the largest request allowed is served, one byte
or one header more is refused and the connection closed), the deadlines, the connection cap, the
key checked before the body, the pipelining bound and the request smuggling shapes; and the clients
that stop reading an answer (:func:`non_reader`, :func:`slow_reader`), whose checks need the server's
own state (tests/rollout/test_http_edge.py).

Shared by tests/rollout/test_http_edge.py (the session API in this process) and
tests/e2e/test_online_edge.py (the session API of a real online-mode run), which run them against
a server with :data:`EDGE_LIMITS`."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass

from nodes.rollout.http1 import HTTPLimits
from rlactors.base.aio import wait_for

# short deadlines and a small connection cap, so that each is reached in a test; sizes as shipped
EDGE_LIMITS = HTTPLimits(
    head_timeout_s=1.0,
    body_timeout_s=1.0,
    body_min_rate=1 << 20,
    idle_timeout_s=2.0,
    max_connections=24,
    max_pipelined=4,
    send_timeout_s=2.0,
)
# the same as config overrides of a run (rollout.workflow_args.http.*)
EDGE_OVERRIDES = [
    f"rollout.workflow_args.http.{k}={getattr(EDGE_LIMITS, k)}"
    for k in (
        "head_timeout_s",
        "body_timeout_s",
        "body_min_rate",
        "idle_timeout_s",
        "max_connections",
        "max_pipelined",
        "send_timeout_s",
    )
]
WAIT_S = 60.0  # a guard against a hang, never a measure: every wait below ends on an event

# (what, request bytes, the status it is refused with): each is answered so and the connection closed
SMUGGLING = [
    ("Content-Length with Transfer-Encoding",
     b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("Transfer-Encoding with Content-Length",
     b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n", 400),
    ("two Content-Lengths", b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}", 400),
    ("a Content-Length list", b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 2, 2\r\n\r\n{}", 400),
    ("obsolete line folding", b"GET /v1/models HTTP/1.1\r\nHost: x\r\n{auth}X-A: b\r\n c\r\n\r\n", 400),
    ("bare LF after the request line", b"GET /v1/models HTTP/1.1\nHost: x\r\n{auth}\r\n", 400),
    ("bare LF after a header", b"GET /v1/models HTTP/1.1\r\nHost: x\n{auth}\r\n", 400),
    ("bare LF ending the head", b"GET /v1/models HTTP/1.1\r\nHost: x\r\n{auth}\n", 400),
    ("bare CR in a header", b"GET /v1/models HTTP/1.1\r\nHost: x\rX: y\r\n{auth}\r\n", 400),
    ("a chunk size not hex", b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400),
    ("a negative chunk size", b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n-2\r\n{}\r\n0\r\n\r\n", 400),
    ("a chunk size that overflows",
     b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n1ffffffffffffffff\r\n{}\r\n0\r\n\r\n", 400),
    ("a 0x chunk size", b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n0x2\r\n{}\r\n0\r\n\r\n", 400),
    ("chunk data longer than its size",
     b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n1\r\n{}\r\n0\r\n\r\n", 400),
    ("a space before a header's colon", b"GET /v1/models HTTP/1.1\r\nHost : x\r\n{auth}\r\n", 400),
    ("two Transfer-Encodings",
     b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("a transfer coding before chunked",
     b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501),
    ("a transfer coding other than chunked", b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: identity\r\n\r\n", 501),
    ("HTTP/2.0 on an HTTP/1 connection", b"GET /v1/models HTTP/2.0\r\nHost: x\r\n{auth}\r\n", 505),
    ("a NUL in a header", b"GET /v1/models HTTP/1.1\r\nHost: x\r\n{auth}X: a\x00b\r\n\r\n", 400),
]  # fmt: skip


@dataclass
class Target:
    """A server under test: where, its key, its limits, and its refusal counters when the test can
    read them (a server in this process)."""

    host: str
    port: int
    key: str
    limits: HTTPLimits
    counters: dict[str, int] | None = None

    @property
    def auth(self) -> bytes:
        return f"Authorization: Bearer {self.key}\r\n".encode()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


async def connect(t: Target) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(t.host, t.port, limit=1 << 20)


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    head = (await wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)).decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in head[1:] if line)}
    body = await wait_for(reader.readexactly(int(headers.get("content-length", "0"))), WAIT_S)
    return Answer(int(head[0].split()[1]), headers, body)


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (EOF or a reset) with nothing more to say."""
    try:
        return await wait_for(reader.read(1), WAIT_S) == b""
    except ConnectionError:
        return True


async def exchange(t: Target, raw: bytes) -> tuple[Answer, bool]:
    """Send ``raw`` on a new connection: the answer, and whether the server then closed it."""
    reader, writer = await connect(t)
    try:
        writer.write(raw)
        answer = await read_answer(reader)
        return answer, answer.headers.get("connection") == "close" and await closed(reader)
    finally:
        writer.close()


def models(t: Target, target: str = "/v1/models", extra: list[tuple[str, str]] | None = None) -> bytes:
    """A legitimate request: the model list, with the key."""
    lines = [f"GET {target} HTTP/1.1", "Host: x", f"Authorization: Bearer {t.key}"]
    lines += [f"{k}: {v}" for k, v in extra or []]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def legit(t: Target) -> None:
    """A legitimate request on a connection of its own is answered 200."""
    answer, _ = await exchange(t, models(t))
    assert answer.status == 200, answer


# -- sizes ------------------------------------------------------------------------------------


async def check_head_size(t: Target) -> None:
    """Request line and headers of exactly max_head_bytes are served; one byte more is 431, closed."""
    base = len(models(t, extra=[("X-Pad", "")]))  # the head with an empty pad: its exact size
    pad = "a" * (t.limits.max_head_bytes - base)
    answer, _ = await exchange(t, models(t, extra=[("X-Pad", pad)]))
    assert answer.status == 200, answer
    answer, was_closed = await exchange(t, models(t, extra=[("X-Pad", pad + "a")]))
    assert answer.status == 431 and was_closed, answer
    assert b"16384" in answer.body or str(t.limits.max_head_bytes).encode() in answer.body


async def check_request_line(t: Target) -> None:
    """A request line as long as the head may be is read whole (then refused for want of the key,
    as it carries no header); one byte longer is 414, closed, before its end is read."""
    fits = t.limits.max_head_bytes - len("GET  HTTP/1.1\r\n\r\n") - len("/v1/models?")
    line = "/v1/models?" + "a" * fits
    answer, _ = await exchange(t, f"GET {line} HTTP/1.1\r\n\r\n".encode())
    assert answer.status == 401, answer
    answer, was_closed = await exchange(t, f"GET {line}a HTTP/1.1\r\n\r\n".encode())
    assert answer.status == 414 and was_closed, answer
    # an 8 MiB line: refused as soon as the limit is passed, the rest never read
    reader, writer = await connect(t)
    writer.write(b"GET /" + b"a" * (8 << 20))
    answer = await read_answer(reader)
    assert answer.status == 414 and await closed(reader)
    writer.close()


async def check_header_count(t: Target) -> None:
    """max_headers headers are served; one more is 431, closed; so are 100,000 in one request."""
    n = t.limits.max_headers - 2  # Host and Authorization are two
    answer, _ = await exchange(t, models(t, extra=[(f"X-{i}", "1") for i in range(n)]))
    assert answer.status == 200, answer
    answer, was_closed = await exchange(t, models(t, extra=[(f"X-{i}", "1") for i in range(n + 1)]))
    assert answer.status == 431 and was_closed, answer
    answer, was_closed = await exchange(t, models(t, extra=[("X", "1")] * 100_000))
    assert answer.status == 431 and was_closed, answer


# -- deadlines --------------------------------------------------------------------------------


async def check_slow_head(t: Target) -> None:
    """A client that trickles its head (a header byte at a time, never ending it) is answered 408
    and closed once head_timeout_s has passed since its first byte, however steadily it trickles;
    meanwhile other clients are served."""
    before = dict(t.counters or {})
    reader, writer = await connect(t)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(t.limits.head_timeout_s / 10)

    trickling = asyncio.ensure_future(trickle())
    try:
        await legit(t)  # served while the trickler holds its connection
        answer = await read_answer(reader)
        assert answer.status == 408 and answer.headers["connection"] == "close", answer
        assert await closed(reader)
    finally:
        trickling.cancel()
        writer.close()
    if t.counters is not None:
        assert t.counters["http_slow_clients"] == before["http_slow_clients"] + 1


async def check_slow_body(t: Target) -> None:
    """A body that stops arriving is answered 408 and closed at body_timeout_s plus its length at
    body_min_rate; the handler never sees it."""
    reader, writer = await connect(t)
    writer.write(
        b"POST /rl/v1/sessions/none/reward HTTP/1.1\r\nHost: x\r\n"
        + t.auth
        + b'Content-Length: 1000\r\n\r\n{"rew'
    )
    answer = await read_answer(reader)
    assert answer.status == 408 and await closed(reader), answer
    writer.close()
    # the same body sent whole is answered (404: no such session), so the 408 was the deadline's
    answer, _ = await exchange(
        t,
        b"POST /rl/v1/sessions/none/reward HTTP/1.1\r\nHost: x\r\n"
        + t.auth
        + b'Content-Length: 13\r\n\r\n{"reward": 1}',
    )
    assert answer.status == 404, answer


async def check_idle(t: Target) -> None:
    """A keep-alive connection idle for idle_timeout_s is closed."""
    reader, writer = await connect(t)
    writer.write(models(t))
    assert (await read_answer(reader)).status == 200
    assert await closed(reader)  # nothing more sent: closed by the idle timeout
    writer.close()


# -- the key, pipelining, connections ---------------------------------------------------------


async def check_key_before_body(t: Target) -> None:
    """A request without the key, announcing a 32 MiB body, is answered 401 from its head: the
    body is never read (the client cannot even push it through the socket buffers), no 100
    Continue is sent, and the connection is closed."""
    size = 32 << 20
    for key in (b"", b"Authorization: Bearer wrong\r\n"):
        reader, writer = await connect(t)
        writer.write(
            b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n"
            + key
            + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % size
        )
        writer.write(
            b"x" * size
        )  # the whole body, queued at once: whatever the server reads leaves the queue
        answer = await read_answer(reader)
        assert answer.status == 401 and answer.headers["connection"] == "close", answer
        unsent = writer.transport.get_write_buffer_size()
        assert unsent > size // 2, f"the server read {size - unsent} bytes of a refused body"
        assert await closed(reader)
        writer.transport.abort()


async def check_pipelining(t: Target) -> None:
    """Of requests pipelined in one write, max_pipelined are parsed and answered, in order, the last
    closing the connection; the rest are not read (the client sends them again)."""
    n = t.limits.max_pipelined
    reader, writer = await connect(t)
    writer.write(b"".join(models(t, f"/v1/models?n={i}") for i in range(n + 3)))
    answers = [await read_answer(reader) for _ in range(n)]
    assert [a.status for a in answers] == [200] * n
    assert [a.headers.get("connection") for a in answers] == [None] * (n - 1) + ["close"]
    assert await closed(reader)
    writer.close()


async def check_connection_cap(t: Target) -> None:
    """Past max_connections a new connection is answered 503 with Retry-After and closed; the open
    ones are still served."""
    before = dict(t.counters or {})
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    refused: Answer | None = None
    try:
        for _ in range(t.limits.max_connections + 1):
            reader, writer = await connect(t)
            writer.write(models(t))
            answer = await read_answer(reader)
            if answer.status == 503:
                refused = answer
                assert await closed(reader)
                writer.close()
                break
            assert answer.status == 200
            held.append((reader, writer))
        assert refused is not None, f"{len(held)} connections held, none refused"
        assert (
            refused.headers["retry-after"] == str(t.limits.retry_after_s)
            and refused.headers["connection"] == "close"
        )
        assert len(held) <= t.limits.max_connections
        for reader, writer in held:  # every open connection is still served
            writer.write(models(t))
            assert (await read_answer(reader)).status == 200
    finally:
        for _, writer in held:
            writer.close()
    if t.counters is not None:
        assert t.counters["http_refused_connections"] == before["http_refused_connections"] + 1


async def check_smuggling(t: Target, raw: bytes, status: int) -> None:
    """A smuggling shape is refused and its connection closed; the server goes on serving."""
    answer, was_closed = await exchange(t, raw.replace(b"{auth}", t.auth))
    assert answer.status == status and was_closed, answer
    assert b"Traceback" not in answer.body and b"Error:" not in answer.body  # no exception text
    await legit(t)


# -- clients that stop reading ----------------------------------------------------------------


async def non_reader(t: Target, raw: bytes) -> socket.socket:
    """A client that sends ``raw`` and never reads: its receive buffer as small as the kernel allows
    (set before connecting: the window it offers), so the server's kernel buffer fills, then its
    transport's."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setblocking(False)
    try:
        await wait_for(loop.sock_connect(sock, (t.host, t.port)), WAIT_S)
        await wait_for(loop.sock_sendall(sock, raw), WAIT_S)
    except BaseException:
        sock.close()
        raise
    return sock


async def read_to_close(sock: socket.socket, at_most: int) -> int:
    """Read what ``sock`` holds until the server's close (EOF or a reset); the bytes read. Past
    ``at_most`` bytes the server has not closed it: AssertionError."""
    loop = asyncio.get_running_loop()
    n = 0
    try:
        while data := await wait_for(loop.sock_recv(sock, 65536), WAIT_S):
            n += len(data)
            assert n <= at_most, f"read {n} bytes and the server has not closed the connection"
    except ConnectionError:
        pass
    return n


async def slow_reader(t: Target, raw: bytes, step: int, pace_s: float, more: Callable[[int], bool]) -> int:
    """A client that sends ``raw`` and reads its answer ``step`` bytes at a time, one read every
    ``pace_s`` (its pace, not a synchronisation), while ``more(bytes read so far)``; the bytes read.
    ConnectionError if the server closes the connection."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * step)
    sock.setblocking(False)
    n = 0
    try:
        await wait_for(loop.sock_connect(sock, (t.host, t.port)), WAIT_S)
        await wait_for(loop.sock_sendall(sock, raw), WAIT_S)
        while more(n):
            await asyncio.sleep(pace_s)
            data = await wait_for(loop.sock_recv(sock, step), WAIT_S)
            if not data:
                raise ConnectionResetError(f"the server closed the connection after {n} bytes")
            n += len(data)
    finally:
        sock.close()
    return n
