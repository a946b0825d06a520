"""A property-based fuzz of the answers nodes/rollout/http1/client.py reads (hypothesis): any valid
answer (1xx answers first or not, framed by length, chunks with extensions and trailers, or the
close; any status, headers and body; an event stream read line by line), split anywhere, reads as
the same status, body and lines; anything else (a valid answer cut or corrupted, random bytes)
ends the request with an answer or a ConnectionError, never another exception, never a hang.

The connection is driven as the event loop drives it, without a socket: its data_received gets
the pieces, then connection_lost (the server closed), so every split point is reached on every
run; tests/rollout/test_http1_client.py does the same over real sockets."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodes.rollout.http1.client import _ClientConnection


class _Transport(asyncio.Transport):
    """What the connection writes to: records whether it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.closing = False

    def write(self, data: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


async def _read(pieces: list[bytes], stream: bool) -> tuple[tuple[int, bytes] | Exception, list[bytes]]:
    """Feed ``pieces`` to a connection with a request out, then close it: (the answer or the
    exception the request ended with, the lines an event stream handed over)."""
    conn, transport, lines = _ClientConnection(), _Transport(), []
    conn.connection_made(transport)
    request = asyncio.ensure_future(
        conn.request(b"POST / HTTP/1.1\r\n\r\n", lines.append if stream else None, None)
    )
    await asyncio.sleep(0)  # one turn: the request is written and waits for its answer
    for piece in pieces:
        if transport.closing:  # the connection gave up on what it read: the rest never arrives
            break
        conn.data_received(piece)
    conn.connection_lost(None)
    await asyncio.sleep(0)  # one turn: the request wakes with whatever ended it
    assert request.done(), "the request still waits after the server closed: a hang"
    try:
        return request.result(), lines
    except Exception as e:  # the test asserts on whatever the request raised
        return e, lines


def read(pieces: list[bytes], stream: bool = False) -> tuple[tuple[int, bytes] | Exception, list[bytes]]:
    return asyncio.run(_read(pieces, stream))


def split(wire: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(wire), *(c % (len(wire) + 1) for c in cuts)})
    return [wire[a:b] for a, b in itertools.pairwise(points)]


def lines_of(body: bytes) -> list[bytes]:
    """The lines an event-stream body is handed over as: each whole line, then an unended last one."""
    *whole, rest = body.split(b"\n")
    return [*whole, rest] if rest else whole


TOKEN = st.text("abcdefghijklmnopqrstuvwxyz-ABCXYZ0123456789", min_size=1, max_size=12)
VALUE = st.text("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789;=,/:.", max_size=20).map(str.strip)
FRAMED_BY = ("content-length", "transfer-encoding", "connection", "content-type", "upgrade", "trailer")


@st.composite
def answers(draw: st.DrawFn) -> tuple[bytes, int, bytes, bool]:
    """A valid answer: (its bytes, status, body, whether it is an event stream)."""
    status = draw(st.sampled_from([200, 201, 204, 206, 301, 304, 400, 404, 429, 500, 503]))
    version = draw(st.sampled_from(["1.1", "1.1", "1.0"]))
    event_stream = status == 200 and draw(st.booleans())
    body = b"" if status in (204, 304) else draw(st.binary(max_size=600))
    if event_stream:
        body = draw(
            st.lists(st.sampled_from([b"data: x", b"", b'data: {"a": 1}', b": ping"]), max_size=8).map(
                b"\n".join
            )
        )
    framing = "length" if status in (204, 304) else draw(st.sampled_from(["length", "chunked", "close"]))
    if version == "1.0" and framing == "chunked":
        framing = "length"
    headers = [
        (k, v) for k, v in draw(st.lists(st.tuples(TOKEN, VALUE), max_size=5)) if k.lower() not in FRAMED_BY
    ]
    if event_stream:
        headers.append(("Content-Type", "text/event-stream"))
    head = "".join(f"{k}: {v}\r\n" for k, v in headers).encode()
    if framing == "length":
        head += b"Content-Length: %d\r\n" % (
            len(body) if status not in (204, 304) else draw(st.integers(0, 9))
        )
        payload = body
    elif framing == "chunked":
        head += b"Transfer-Encoding: chunked\r\n"
        cuts = split(body, draw(st.lists(st.integers(0, 600), max_size=6))) if body else []
        ext = draw(st.sampled_from([b"", b";ext=1", b";a=b;c"]))
        trailers = b"".join(
            b"%s: %s\r\n" % (k.encode(), v.encode())
            for k, v in draw(st.lists(st.tuples(TOKEN, VALUE), max_size=2))
            if k.lower() not in FRAMED_BY
        )
        payload = (
            b"".join(b"%x%s\r\n%s\r\n" % (len(c), ext, c) for c in cuts if c) + b"0\r\n" + trailers + b"\r\n"
        )
    else:
        payload = body
    informational = b"".join(
        b"HTTP/1.1 %d Info\r\n%s\r\n" % (code, b"Link: </x>\r\n" if code == 103 else b"")
        for code in draw(st.lists(st.sampled_from([100, 102, 103]), max_size=2))
    )
    reason = draw(st.sampled_from([b"OK", b"", b"Some Reason"]))
    wire = informational + b"HTTP/%s %d %s\r\n%s\r\n%s" % (version.encode(), status, reason, head, payload)
    return wire, status, body, event_stream


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(answers(), st.lists(st.integers(0, 4000), max_size=8))
def test_any_valid_answer_split_anywhere_reads_the_same(
    answer: tuple[bytes, int, bytes, bool], cuts: list[int]
) -> None:
    wire, status, body, event_stream = answer
    got, lines = read(split(wire, cuts), stream=event_stream)
    if event_stream:
        assert got == (status, b"") and lines == lines_of(body)
    else:
        assert got == (status, body)


@SETTINGS
@given(
    answers(),
    st.lists(st.integers(0, 4000), max_size=6),
    st.sampled_from(["cut", "flip", "insert"]),
    st.integers(0, 4000),
    st.binary(min_size=1, max_size=4),
)
def test_a_cut_or_corrupted_answer_ends_cleanly(
    answer: tuple[bytes, int, bytes, bool], cuts: list[int], how: str, at: int, junk: bytes
) -> None:
    wire, *_, event_stream = answer
    at %= len(wire)
    if how == "cut":
        wire = wire[:at]
    elif how == "flip":
        wire = wire[:at] + bytes([wire[at] ^ junk[0]]) + wire[at + 1 :]
    else:
        wire = wire[:at] + junk + wire[at:]
    got, _ = read(split(wire, cuts), stream=event_stream)
    assert isinstance(got, tuple | ConnectionError), repr(got)


@SETTINGS
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=4))
def test_random_bytes_end_the_request_cleanly(wire: bytes, cuts: list[int]) -> None:
    got, _ = read(split(wire, cuts), stream=True)
    assert isinstance(got, ConnectionError) or (isinstance(got, tuple) and isinstance(got[0], int)), repr(got)


def test_answers_split_at_every_byte_read_the_same() -> None:
    sse = b"data: 1\n\ndata: 22\n\n"
    cases = [
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", False, (200, b"hello")),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nT: 1\r\n\r\n",
         False, (200, b"abcde")),
        (b"HTTP/1.1 500 Oops\r\nContent-Type: text/plain\r\n\r\nclose-delimited", False, (500, b"close-delimited")),
        (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
         + b"%x\r\n%s\r\n0\r\n\r\n" % (len(sse), sse), True, (200, b"")),
    ]  # fmt: skip
    for wire, stream, expected in cases:
        for i in range(len(wire) + 1):
            got, lines = read([wire[:i], wire[i:]], stream)
            assert got == expected, (wire, i)
            assert lines == ([b"data: 1", b"", b"data: 22", b""] if stream else []), (wire, i)
        got, lines = read([wire[i : i + 1] for i in range(len(wire))], stream)  # a byte at a time
        assert got == expected


def test_an_upgrade_ends_the_request_inside_the_protocol() -> None:
    """httptools signals a 101 (or any upgrade) with an exception of its own, no HttpParserError:
    it must end the request there, not escape data_received (asyncio would log a fatal error) or
    leave the request to its timeout."""
    upgrade = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    for pieces in ([upgrade], [upgrade + b"\x81\x00"], [upgrade[:20], upgrade[20:]]):
        got, _ = read(pieces)
        assert isinstance(got, ConnectionError) and "switched protocols" in str(got)
