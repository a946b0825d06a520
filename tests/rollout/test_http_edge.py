"""The protocol-edge checks (tests/rollout/http_edge.py) against online mode's session API and
OpenAI-compatible endpoint served in this process, as a rollout actor serves them; then what only a
server in this process shows: a 500 names the id its log line carries and no exception text, a
peer's refusals are logged once a minute and all counted, no request is parsed while another is
answered; and the clients that stop reading an answer (the send bound, send_timeout_s): a stream of
each API or a whole answer not read is reset and counted, its handler released, the buffer it holds
bounded, while a slow but steady reader keeps its stream. tests/e2e/test_online_edge.py runs the
edge checks against a real online-mode run (not the readers': they need this server's state)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import structlog

from nodes.rollout.client import GenRequest, GenResult
from nodes.rollout.http1 import HTTPServer, Request, Response
from nodes.rollout.http1.server import SEND_BUFFER
from nodes.rollout.sessions import OnlineConfig, OnlineWorkflow
from rlactors.base.aio import wait_for
from tests.rollout import http_edge as edge
from tests.rollout.test_sessions import KEY, Backend, tokenizer  # noqa: F401 (a fixture)


@pytest.fixture
async def target(tokenizer: Any) -> AsyncIterator[edge.Target]:  # noqa: F811
    wf = OnlineWorkflow(tokenizer, None, OnlineConfig(http=edge.EDGE_LIMITS))  # type: ignore[arg-type]
    api = await wf.start(Backend(tokenizer))
    host, port = api.endpoint.url.removeprefix("http://").rsplit(":", 1)
    try:
        yield edge.Target(host, int(port), KEY, edge.EDGE_LIMITS, wf.counters)
    finally:
        await wf.aclose()


async def test_head_size_at_its_edge(target: edge.Target) -> None:
    await edge.check_head_size(target)


async def test_request_line_at_its_edge(target: edge.Target) -> None:
    await edge.check_request_line(target)


async def test_header_count_at_its_edge(target: edge.Target) -> None:
    await edge.check_header_count(target)


async def test_a_trickled_head_is_closed_counted_and_delays_no_one(target: edge.Target) -> None:
    await edge.check_slow_head(target)


async def test_a_stalled_body_is_closed(target: edge.Target) -> None:
    await edge.check_slow_body(target)


async def test_an_idle_connection_is_closed(target: edge.Target) -> None:
    await edge.check_idle(target)


async def test_the_key_is_checked_before_the_body_is_read(target: edge.Target) -> None:
    before = target.counters["http_unauthorized"] if target.counters else 0
    await edge.check_key_before_body(target)
    assert target.counters is not None and target.counters["http_unauthorized"] == before + 2


async def test_pipelined_requests_past_the_bound_are_not_read(target: edge.Target) -> None:
    await edge.check_pipelining(target)


async def test_past_the_connection_cap_new_ones_get_503_open_ones_are_served(target: edge.Target) -> None:
    await edge.check_connection_cap(target)


@pytest.mark.parametrize("raw, status", [c[1:] for c in edge.SMUGGLING], ids=[c[0] for c in edge.SMUGGLING])
async def test_smuggling_shapes_are_refused_and_closed(target: edge.Target, raw: bytes, status: int) -> None:
    before = target.counters["http_bad_requests"] if target.counters else 0
    await edge.check_smuggling(target, raw, status)
    assert target.counters is not None and target.counters["http_bad_requests"] == before + 1


# -- what a server in this process shows --------------------------------------------------------


def error_body(status: int, message: str) -> Response:
    return Response(status, f"error {status}: {message}".encode(), "text/plain")


async def test_a_500_names_the_id_its_log_line_carries_and_no_exception_text() -> None:
    async def fails(req: Request) -> Response:
        raise ValueError("secret-detail /home/user/path")

    server = HTTPServer(fails, error_body)
    port = await server.start("127.0.0.1", 0)
    t = edge.Target("127.0.0.1", port, "", server.limits)
    try:
        with structlog.testing.capture_logs() as logs:
            answer, _ = await edge.exchange(t, b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    finally:
        await server.aclose()
    assert answer.status == 500 and b"secret" not in answer.body and b"ValueError" not in answer.body
    [line] = [entry for entry in logs if entry["event"] == "http1.handler_error"]
    assert line["error_id"].encode() in answer.body and len(line["error_id"]) == 12


async def test_the_endpoint_500_names_its_log_id(target: edge.Target) -> None:
    """A route that raises inside the endpoint (a mounted handler here) gets OpenAI's error body with
    the id, not the exception."""
    # the session API's handler, broken: its request bodies are read with a function that raises
    import nodes.rollout.sessions as sessions

    original = sessions._body
    sessions._body = lambda request: 1 / 0  # type: ignore[assignment,misc]
    try:
        with structlog.testing.capture_logs() as logs:
            answer, _ = await edge.exchange(
                target,
                b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\n"
                + target.auth
                + b"Content-Length: 2\r\n\r\n{}",
            )
    finally:
        sessions._body = original
    assert answer.status == 500 and b"ZeroDivision" not in answer.body and b"division" not in answer.body
    [line] = [entry for entry in logs if entry["event"] == "openai_endpoint.error"]
    assert line["error_id"].encode() in answer.body


async def test_a_peers_refusals_are_logged_once_a_minute_and_all_counted(target: edge.Target) -> None:
    before = target.counters["http_bad_requests"] if target.counters else 0
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            answer, _ = await edge.exchange(target, b"NOT HTTP\r\n\r\n")
            assert answer.status == 400
    assert target.counters is not None and target.counters["http_bad_requests"] == before + 5
    assert len([entry for entry in logs if entry["event"] == "http1.refused"]) == 1


async def test_nothing_is_parsed_while_a_request_is_answered() -> None:
    """A request sent while another is answered waits unread in the socket: the handler sees it only
    after the first answer; max_pipelined bounds what one read queues."""
    seen: list[str] = []
    held, release = asyncio.Event(), asyncio.Event()

    async def app(req: Request) -> Response:
        seen.append(req.path)
        if req.path == "/hold":
            held.set()
            await release.wait()
        return Response(200, req.path.encode(), "text/plain")

    server = HTTPServer(app, error_body)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        await wait_for(held.wait(), 30)
        writer.write(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        [conn] = server._connections
        await wait_for(_until(lambda: conn._paused_reading), 30)  # read once, stashed, reading paused
        assert seen == ["/hold"] and not conn._queue
        release.set()
        assert (await edge.read_answer(reader)).body == b"/hold"
        assert (await edge.read_answer(reader)).body == b"/next" and seen == ["/hold", "/next"]
        writer.close()
    finally:
        await server.aclose()


async def _until(predicate: Any) -> None:
    """Until the server's state says so: the transport's pause has no event to wait on."""
    while not predicate():  # noqa: ASYNC110
        await asyncio.sleep(0.01)


async def test_a_chunked_body_arriving_above_the_min_rate_outlives_body_timeout() -> None:
    """A body's deadline grows with what arrives: a chunked body sent steadily at ten times
    body_min_rate is read whole though it takes longer than body_timeout_s; the same body stopped
    half-way is answered 408."""
    limits = edge.HTTPLimits(body_timeout_s=0.5, body_min_rate=1000)

    async def app(req: Request) -> Response:
        return Response(200, b"%d" % len(req.body), "text/plain")

    server = HTTPServer(app, error_body, limits)
    port = await server.start("127.0.0.1", 0)
    try:
        for stop_after in (None, 3):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(15):  # 1.5 s at 10,000 bytes/s: three body_timeout_s
                if i == stop_after:
                    break
                writer.write(b"3e8\r\n" + b"x" * 1000 + b"\r\n")
                await asyncio.sleep(0.1)  # the client's pace, not a synchronisation
            else:
                writer.write(b"0\r\n\r\n")
            answer = await edge.read_answer(reader)
            assert (answer.status, answer.body) == (
                (200, b"15000") if stop_after is None else (408, answer.body)
            )
            writer.close()
    finally:
        await server.aclose()


# -- clients that stop reading --------------------------------------------------------------------

CHUNK = b"x" * 1024
FRAMED = len(b"%x\r\n%b\r\n" % (len(CHUNK), CHUNK))  # one chunk as written: its size line, its CRLFs


class Streams:
    """A server whose /stream answers an endless stream of CHUNKs (until the client is gone) and
    anything else 200; each stream's end (the ConnectionError its write raised) resolves a future."""

    def __init__(self, limits: edge.HTTPLimits) -> None:
        self.server = HTTPServer(self.app, error_body, limits)
        self.ended: list[asyncio.Future[str]] = []

    async def app(self, req: Request) -> Response | None:
        if req.path != "/stream":
            return Response(200, b"ok", "text/plain")
        ended = asyncio.get_running_loop().create_future()
        self.ended.append(ended)
        out = await req.stream(200, {"Content-Type": "text/plain"})
        try:
            while True:
                await out.write(CHUNK)
        except ConnectionError as e:
            ended.set_result(str(e))
        return None

    def streaming(self) -> list[Any]:
        return [c for c in self.server._connections if c._streaming is not None]


def waiting(conn: Any) -> bool:
    """The connection's writer waits: its transport's buffer is past the high-water mark."""
    return conn._drained is not None and not conn._drained.done()


async def test_clients_that_stop_reading_a_stream_are_reset_counted_and_delay_no_one() -> None:
    """Two clients that ask for a stream and never read: each stream's writer waits once the
    transport holds SEND_BUFFER (the buffer never exceeds it by more than one chunk), others are
    served, and after send_timeout_s without a byte taken each connection is reset and counted, the
    peer logged once, and each handler's write raises ConnectionError (it ends as when a client goes
    away)."""
    streams = Streams(edge.HTTPLimits(send_timeout_s=1.0))
    port = await streams.server.start("127.0.0.1", 0)
    t = edge.Target("127.0.0.1", port, "", streams.server.limits, streams.server.counters)
    socks: list[Any] = []
    try:
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                socks.append(await edge.non_reader(t, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"))
            both = lambda: sum(waiting(c) for c in streams.streaming()) == 2  # noqa: E731
            await wait_for(_until(both), edge.WAIT_S)
            conns = streams.streaming()
            assert all(c.transport.get_write_buffer_size() <= SEND_BUFFER + FRAMED for c in conns)
            answer, _ = await edge.exchange(t, b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")
            assert answer.status == 200  # served while the streams wait
            assert all(c.transport.get_write_buffer_size() <= SEND_BUFFER + FRAMED for c in conns)
            # the handlers' writes raised: the connections were reset
            await wait_for(asyncio.gather(*streams.ended), edge.WAIT_S)
            assert all(c.gone for c in conns) and t.counters is not None
            assert t.counters["http_stalled_readers"] == 2
            for sock in socks:  # what their buffers held, then the reset
                assert await edge.read_to_close(sock, SEND_BUFFER) < SEND_BUFFER
    finally:
        for sock in socks:
            sock.close()
        await streams.server.aclose()
    [line] = [e for e in logs if e["event"] == "http1.refused"]  # one peer: logged once
    assert line["counter"] == "http_stalled_readers" and "took nothing" in line["why"]


async def test_a_slow_but_steady_reader_is_not_closed() -> None:
    """A client that reads its stream slowly, a little at a time, keeps it however long the writer
    waits on it: the transport's buffer stays full past send_timeout_s (twice over here) while the
    client takes bytes (the kernel's buffer of megabytes drains slowly: the bytes it acknowledges
    count, not only the transport's), and the connection is not closed."""
    limits = edge.HTTPLimits(send_timeout_s=1.0)
    pace_s = 0.05
    streams = Streams(limits)
    port = await streams.server.start("127.0.0.1", 0)
    t = edge.Target("127.0.0.1", port, "", limits, streams.server.counters)
    full = 0  # consecutive reads during which the writer had bytes waiting in the transport

    def more(_: int) -> bool:
        nonlocal full
        conns = streams.streaming()
        full = full + 1 if conns and conns[0].transport.get_write_buffer_size() else 0
        return full < 2 * limits.send_timeout_s / pace_s

    try:
        n = await edge.slow_reader(t, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n", 8192, pace_s, more)
        [ended] = streams.ended
        assert await wait_for(ended, edge.WAIT_S)  # the client closed: the handler's write raised
        assert n > 0 and streams.server.counters["http_stalled_readers"] == 0
    finally:
        await streams.server.aclose()


async def test_closing_the_server_drops_a_connection_its_client_does_not_read() -> None:
    """The server's aclose drops a connection whose answer waits on its client at once, not after
    send_timeout_s (closing it would wait for the answer to be sent)."""
    streams = Streams(edge.HTTPLimits())  # send_timeout_s as shipped: far past this test's guard
    port = await streams.server.start("127.0.0.1", 0)
    t = edge.Target("127.0.0.1", port, "", streams.server.limits)
    sock = await edge.non_reader(t, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        await wait_for(_until(lambda: any(waiting(c) for c in streams.streaming())), edge.WAIT_S)
        [conn] = streams.streaming()
        await streams.server.aclose()
        await wait_for(_until(lambda: conn.gone), streams.server.limits.send_timeout_s / 2)
    finally:
        sock.close()
        await streams.server.aclose()


async def test_a_whole_answer_not_read_is_reset_not_held() -> None:
    """A large answer (not streamed) to a client that never reads, on a connection to close after
    it: closing waits for the answer to be sent, so without the send bound it would be held for ever;
    it is reset after send_timeout_s and counted."""
    big = b"y" * (8 << 20)

    async def app(req: Request) -> Response:
        return Response(200, big, "text/plain")

    server = HTTPServer(app, error_body, edge.HTTPLimits(send_timeout_s=1.0))
    port = await server.start("127.0.0.1", 0)
    t = edge.Target("127.0.0.1", port, "", server.limits, server.counters)
    try:
        sock = await edge.non_reader(t, b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reset = lambda: server.counters["http_stalled_readers"] == 1 and not server._connections  # noqa: E731
        await wait_for(_until(reset), edge.WAIT_S)  # counted, then its connection lost a turn later
        assert await edge.read_to_close(sock, len(big)) < len(big)
        sock.close()
        await edge.legit(edge.Target("127.0.0.1", port, "", server.limits))
    finally:
        await server.aclose()


async def test_pipelined_requests_its_client_does_not_read_are_not_parsed() -> None:
    """A client that pipelines requests and never reads their answers: once the transport's buffer is
    past its high-water mark the next request is not parsed (the server holds at most SEND_BUFFER and
    one answer, not an answer per request the client sends), and after send_timeout_s the
    connection is reset and counted."""
    answer = b"z" * 8192
    served = 0

    async def app(req: Request) -> Response:
        nonlocal served
        served += 1
        return Response(200, answer, "text/plain")

    # max_pipelined out of the way: its bound closes a connection that sends too many at once, not
    # one that sends them a few at a time
    server = HTTPServer(app, error_body, edge.HTTPLimits(send_timeout_s=1.0, max_pipelined=1 << 20))
    port = await server.start("127.0.0.1", 0)
    t = edge.Target("127.0.0.1", port, "", server.limits, server.counters)
    n = 4096  # 32 MiB of answers; the requests (120 KiB) fit the kernel's buffers
    peak = 0

    def reset() -> bool:
        nonlocal peak
        for c in server._connections:
            if c.transport is not None:
                peak = max(peak, c.transport.get_write_buffer_size())
        return server.counters["http_stalled_readers"] == 1 and not server._connections

    sock = await edge.non_reader(t, b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n" * n)
    try:
        await wait_for(_until(reset), edge.WAIT_S)
        assert 0 < peak <= SEND_BUFFER + len(answer) + 256, peak
        assert served < n // 4, served  # what the kernel's buffers took, and one more
    finally:
        sock.close()
        await server.aclose()


class LongBackend(Backend):
    """Answers ``n`` tokens of 80 characters each: a stream of megabytes, more than the kernel's
    buffers hold."""

    def __init__(self, tok: Any, n: int) -> None:
        super().__init__(tok)
        [token] = tok.encode("#" * 80, add_special_tokens=False)
        self.ids = [token] * n

    async def agenerate(self, request: GenRequest) -> GenResult:
        self.calls += 1
        n = len(self.ids)
        return GenResult(
            request.rid or "",
            self.ids,
            [-0.5] * n,
            [3] * n,
            "length",
            "",
            len(request.input_ids),
            [0],
            "fake",
        )


STREAMS = {  # a streamed answer of each API the endpoint serves: its path under base_url, its body
    "chat completions": ("/chat/completions", {"model": "p", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
    "responses": ("/responses", {"model": "p", "input": "hi", "stream": True}),
    "messages": ("/messages", {"model": "p", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": True}),
}  # fmt: skip
EVENT = 1024  # one event of one token's text (a few hundred bytes) is shorter


def _max_send_buffer() -> int:
    """What a TCP socket's send buffer may grow to (Linux's net.ipv4.tcp_wmem; else its default):
    at 4 MiB the kernel holds about 1.8 MB of a stream before the transport's buffer fills, and
    15,000 tokens are about 3 MB of the smallest events (Messages')."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    return 4 << 20


def post(t: edge.Target, path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n".encode()
    return head + t.auth + b"\r\n" + data


@pytest.fixture
async def session(tokenizer: Any) -> AsyncIterator[tuple[edge.Target, OnlineWorkflow, dict[str, Any]]]:  # noqa: F811
    """A session of the session API in this process, whose completions are streams of megabytes."""
    backend = LongBackend(tokenizer, 15_000 * math.ceil(_max_send_buffer() / (4 << 20)))
    wf = OnlineWorkflow(tokenizer, None, OnlineConfig(n_samples=1, http=edge.EDGE_LIMITS))  # type: ignore[arg-type]
    api = await wf.start(backend)
    host, port = api.endpoint.url.removeprefix("http://").rsplit(":", 1)
    t = edge.Target(host, int(port), KEY, edge.EDGE_LIMITS, wf.counters)
    episode = asyncio.ensure_future(wf.arun_episode(backend, {}, "online/e0/0"))
    try:
        await asyncio.sleep(0)  # the slot is offered
        answer, _ = await edge.exchange(t, post(t, "/rl/v1/sessions", {}))
        assert answer.status == 200, answer
        yield t, wf, json.loads(answer.body)
    finally:
        episode.cancel()
        await asyncio.gather(episode, return_exceptions=True)
        await wf.aclose()


@pytest.mark.parametrize("api", list(STREAMS))
async def test_a_stream_its_client_stops_reading_is_reset_and_its_turn_kept(
    session: tuple[edge.Target, OnlineWorkflow, dict[str, Any]], api: str
) -> None:
    """Each streamed API of the endpoint, to a client that never reads: the stream's handler waits
    with the transport's buffer at its mark (one event over at most), others are served, and after
    send_timeout_s the connection is reset and counted; the handler then ends as for a client that
    went away (the generation goes on for the episode, its writes dropped): the session's turn is
    kept whole, its reward taken."""
    t, wf, s = session
    assert wf.api is not None
    server = wf.api.endpoint._server
    path, body = STREAMS[api]
    sock = await edge.non_reader(t, post(t, urlsplit(s["base_url"]).path + path, body))
    try:
        await wait_for(_until(lambda: any(waiting(c) for c in server._connections)), edge.WAIT_S)
        [conn] = [c for c in server._connections if waiting(c)]
        handler = conn._task
        assert handler is not None and conn.transport.get_write_buffer_size() <= SEND_BUFFER + EVENT
        await edge.legit(t)  # served while the stream waits
        await wait_for(handler, edge.WAIT_S)  # reset: its write raised, the handler went on and ended
        assert conn.gone and wf.counters["http_stalled_readers"] == 1
        assert await edge.read_to_close(sock, SEND_BUFFER) < SEND_BUFFER
    finally:
        sock.close()
    answer, _ = await edge.exchange(t, post(t, f"/rl/v1/sessions/{s['id']}/reward", {"reward": 1}))
    assert answer.status == 200 and json.loads(answer.body)["trajectories"] == 1, answer
