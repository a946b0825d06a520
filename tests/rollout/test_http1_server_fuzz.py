"""A property-based fuzz of the requests nodes/rollout/http1/server.py reads (hypothesis, bounded and
derandomized: the same examples on every run): valid pipelined requests (any method, target,
headers; bodies framed by length or in chunks with extensions and trailers), split anywhere, reach
the handler whole and in order and are answered in order on the same connection; a head whose size
is anywhere around max_head_bytes is served or refused (431) by its exact size whatever the reads it
arrives in; anything else (a valid request cut or corrupted, random bytes) is answered, closed or
waited for, never raises out of the connection, never reaches a callback's defect.

The connection is driven as the event loop drives it, without a socket: data_received gets the
pieces while reading is not paused (as a transport delivers them), the answers run on the loop.
tests/rollout/test_http_edge.py does the same over real sockets."""

from __future__ import annotations

import asyncio
import itertools
import re
from typing import Any

import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodes.rollout.http1 import HTTPLimits, HTTPServer, Request, Response
from nodes.rollout.http1.server import _Connection

FUZZ = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


class _Transport(asyncio.Transport):
    """What the connection writes to: records the bytes, whether it closed (or ended its writes,
    closing soon) and paused reading."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closing = self.paused = self.eof = False

    def write(self, data: Any) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0  # what is written is taken at once


async def _serve(
    pieces: list[bytes], limits: HTTPLimits
) -> tuple[list[Request], list[tuple[int, bytes]], bool]:
    """Feed ``pieces`` as a transport would: (the requests the handler saw, the answers written,
    whether the connection was closed)."""
    seen: list[Request] = []

    async def app(req: Request) -> Response:
        seen.append(req)
        await asyncio.sleep(0)  # an answer takes a turn of the loop: the next pieces arrive meanwhile
        return Response(200, b"%d" % len(seen), "text/plain")

    server = HTTPServer(app, lambda status, msg: Response(status, msg.encode(), "text/plain"), limits)
    server._loop = asyncio.get_running_loop()
    conn, transport = _Connection(server), _Transport()
    conn.connection_made(transport)
    todo = list(pieces)
    quiet = 0
    while quiet < 20 and not (transport.closing or transport.eof):  # until nothing moves for a few turns
        if todo and not transport.paused:
            conn.data_received(todo.pop(0))
            quiet = 0
        else:
            quiet += 1
        await asyncio.sleep(0)
    closing = transport.closing or transport.eof
    conn.connection_lost(None)
    if conn._task is not None:
        conn._task.cancel()
    return seen, _answers(bytes(transport.out)), closing


def serve(pieces: list[bytes], limits: HTTPLimits) -> tuple[list[Request], list[tuple[int, bytes]], bool]:
    with structlog.testing.capture_logs() as logs:
        out = asyncio.run(_serve(pieces, limits))
    assert not [e for e in logs if e["event"] == "http1.parser_callback_failed"], logs  # a defect of ours
    return out


def _answers(wire: bytes) -> list[tuple[int, bytes]]:
    out = []
    while wire:
        head, _, rest = wire.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status == 100:
            wire = rest
            continue
        length = int(re.search(rb"Content-Length: (\d+)", head)[1])  # type: ignore[index]
        out.append((status, rest[:length]))
        wire = rest[length:]
    return out


def split(wire: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(wire), *(c % (len(wire) + 1) for c in cuts)})
    return [wire[a:b] for a, b in itertools.pairwise(points)]


TOKEN = st.text("abcdefghijklmnopqrstuvwxyz-ABCXYZ0123456789", min_size=1, max_size=12)
VALUE = st.text("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789;=,/:.\t", max_size=30).map(
    lambda v: v.strip(" \t")
)
RESERVED = ("content-length", "transfer-encoding", "connection", "expect", "upgrade", "host")
PATH = st.lists(TOKEN, max_size=4).map(lambda parts: "/" + "/".join(parts))


@st.composite
def requests(draw: Any) -> tuple[bytes, tuple[str, str, str, dict[str, str], bytes]]:
    """A valid request: its bytes, and what the handler should see of it."""
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
    path, query = draw(PATH), draw(st.one_of(st.just(""), TOKEN.map(lambda q: f"a={q}")))
    headers = draw(st.dictionaries(TOKEN.filter(lambda n: n.lower() not in RESERVED), VALUE, max_size=6))
    headers = {k.lower(): v for k, v in headers.items()}
    body = draw(st.binary(max_size=300)) if method != "GET" else b""
    target = path + (f"?{query}" if query else "")
    lines = [f"{method} {target} HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in headers.items())]
    if body and draw(st.booleans()):  # chunked: random chunk sizes, extensions, trailers
        cuts = draw(st.lists(st.integers(0, len(body)), max_size=5))
        chunks = split(body, cuts)
        ext = draw(st.sampled_from(["", ";x=1", ";name"]))
        framed = b"".join(b"%x%s\r\n%s\r\n" % (len(c), ext.encode(), c) for c in chunks if c)
        trailer = draw(st.sampled_from([b"", b"X-Trailer: 1\r\n"]))
        wire = (
            ("\r\n".join([*lines, "Transfer-Encoding: chunked"]) + "\r\n\r\n").encode()
            + framed
            + b"0\r\n"
            + trailer
            + b"\r\n"
        )
    else:
        wire = ("\r\n".join([*lines, f"Content-Length: {len(body)}"]) + "\r\n\r\n").encode() + body
    return wire, (method, path, query, headers, body)


LOOSE = HTTPLimits(max_pipelined=64, max_body_bytes=1 << 20)


@FUZZ
@given(st.lists(requests(), min_size=1, max_size=6), st.lists(st.integers(0, 1 << 16), max_size=12))
def test_valid_pipelined_requests_split_anywhere_are_served_whole_and_in_order(
    reqs: list[tuple[bytes, Any]], cuts: list[int]
) -> None:
    wire = b"".join(w for w, _ in reqs)
    seen, answers, closed = serve(split(wire, cuts), LOOSE)
    assert [(r.method, r.path, r.query, r.body) for r in seen] == [
        (m, p, q, b) for _, (m, p, q, _h, b) in reqs
    ]
    for r, (_, (_m, _p, _q, headers, _b)) in zip(seen, reqs, strict=True):
        assert all(r.headers[k] == v for k, v in headers.items())
    assert answers == [(200, b"%d" % (i + 1)) for i in range(len(reqs))] and not closed


@FUZZ
@given(st.integers(-40, 40), st.integers(0, 90), st.lists(st.integers(0, 1 << 15), max_size=8))
def test_a_head_around_the_limit_is_judged_by_its_exact_size_whatever_the_reads(
    delta: int, n_headers: int, cuts: list[int]
) -> None:
    limits = HTTPLimits(max_head_bytes=4096)
    lines = ["GET /p HTTP/1.1", "Host: x", *(f"X-{i}: v" for i in range(n_headers)), "X-Pad: "]
    pad = limits.max_head_bytes + delta - len(("\r\n".join(lines) + "\r\n\r\n").encode())
    if pad < 1:
        return
    wire = ("\r\n".join(lines) + "a" * pad + "\r\n\r\n").encode()
    seen, answers, closed = serve(split(wire, cuts), limits)
    if delta <= 0:
        assert len(seen) == 1 and answers == [(200, b"1")] and not closed
    else:
        assert not seen and [s for s, _ in answers] == [431] and closed


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=400),
        st.tuples(requests(), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=3)).map(
            lambda t: t[0][0][: t[1] % (len(t[0][0]) + 1)] + t[2] + t[0][0][t[1] % (len(t[0][0]) + 1) + 1 :]
        ),
        requests().map(lambda r: r[0][: len(r[0]) // 2]),
    ),
    st.lists(st.integers(0, 1 << 16), max_size=8),
)
def test_anything_else_is_answered_closed_or_waited_for_never_an_exception(
    wire: bytes, cuts: list[int]
) -> None:
    seen, answers, closed = serve(split(wire, cuts), LOOSE)
    assert len(answers) >= len(seen) - 1  # every request taken is answered (the last, maybe, after the cut)
    assert all(s in (200, 400, 408, 413, 414, 431, 501, 505) for s, _ in answers)
    if any(s != 200 for s, _ in answers):
        assert closed  # a refusal closes the connection: its bytes cannot be skipped
