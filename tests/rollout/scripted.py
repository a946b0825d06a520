"""Scripted SGLang servers on loopback sockets, for the rollout client's tests: each named server
(``a``, ``b``, ...) listens on 127.0.0.1 and answers each request from the test's script, so the
client's real wire (nodes/rollout/pool.py, http1) carries every post. A script can answer with a
status and body, an event stream (cut off or whole), or a dropped connection; a request whose
client hangs up has its handler cancelled, as a server aborts a request whose client left."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httptools
import orjson
import pytest

from protocols.http.sglang import weight_version_spans

HOST = "127.0.0.1"


@dataclass
class Answer:
    """What a scripted server sends: a status and body (``Content-Length``), or with ``parts`` a
    chunked answer of those parts that ends (or, ``cut``, breaks off before its last chunk)."""

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    parts: list[bytes] | None = None
    cut: bool = False

    def encode(self) -> bytes:
        head = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items()).encode()
        if self.parts is None:
            return b"HTTP/1.1 %d X\r\n%sContent-Length: %d\r\n\r\n%s" % (
                self.status,
                head,
                len(self.body),
                self.body,
            )
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in self.parts if p)
        end = b"" if self.cut else b"0\r\n\r\n"
        return b"HTTP/1.1 %d X\r\n%sTransfer-Encoding: chunked\r\n\r\n%s%s" % (self.status, head, chunks, end)


DROP = Answer(0)  # close the connection without an answer (a server that died mid-request)


def answer(status: int = 200, json: Any = None, text: str | None = None) -> Answer:
    """A whole answer: ``json`` as JSON, or ``text``, or an empty body."""
    if json is not None:
        return Answer(status, orjson.dumps(json), {"Content-Type": "application/json"})
    return Answer(status, (text or "").encode(), {"Content-Type": "text/plain"})


def sse(parts: list[bytes], cut: bool = False) -> Answer:
    """An event stream of ``parts``, each its own chunk; ``cut``: the connection breaks after them."""
    return Answer(200, headers={"Content-Type": "text/event-stream"}, parts=parts, cut=cut)


def reply(
    ids: list[int],
    finish: str = "length",
    cached: int = 0,
    legacy: bool = False,
    versions: list[Any] | None = None,
    **fin: Any,
) -> Answer:
    """SGLang's answer to a ``/generate`` that produced ``ids`` (log-prob -0.25 each)."""
    meta: dict[str, Any] = {
        "finish_reason": {"type": finish, **fin},
        "prompt_tokens": 0,
        "completion_tokens": len(ids),
        "cached_tokens": cached,
        "weight_version": "w",
        "output_token_logprobs": [[-0.25, t, None] for t in ids],
    }
    if versions is not None:
        meta["weight_versions"] = weight_version_spans(versions, "w")  # as SGLang 0.5.23 sends them
    body: dict[str, Any] = {"text": "".join(chr(97 + t % 26) for t in ids), "meta_info": meta}
    if not legacy:
        body["output_ids"] = ids
    return answer(200, json=body)


@dataclass
class Posted:
    """A request as a scripted server got it: which server (``host``, the script's name), path, body."""

    host: str
    path: str
    content: bytes

    def json(self) -> Any:
        return orjson.loads(self.content)


Handler = Callable[[Posted], Answer | Awaitable[Answer]]


class _Conn(asyncio.Protocol):
    """One client connection to a scripted server: requests answered in order, one at a time."""

    def __init__(self, servers: Servers, host: str) -> None:
        self.servers, self.host = servers, host
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: asyncio.Queue[Posted] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self._url, self._body = b"", b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.servers._conns.add(self)
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)  # a malformed request fails the test loudly, in the loop's log

    def on_message_begin(self) -> None:
        self._url, self._body = b"", b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.queue.put_nowait(Posted(self.host, self._url.decode(), self._body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.servers._conns.discard(self)
        if self.task is not None:
            self.task.cancel()  # the client left: its request's handler stops, as a server's abort

    async def _serve(self) -> None:
        assert self.transport is not None
        while True:
            posted = await self.queue.get()
            out = self.servers.handler(posted)
            got = await out if asyncio.iscoroutine(out) else out
            if got is DROP:
                self.transport.close()
                return
            self.transport.write(got.encode())
            if got.cut:
                self.transport.close()
                return


class Servers:
    """Scripted servers, one per name, answering through ``handler``; ``url(name)`` is one's URL.
    Made by the :func:`serve` fixture, which closes them after the test."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self._listening: dict[str, tuple[asyncio.Server, str]] = {}
        self._conns: set[_Conn] = set()

    async def start(self, *names: str) -> Servers:
        loop = asyncio.get_running_loop()
        for name in names:
            server = await loop.create_server(lambda n=name: _Conn(self, n), HOST, 0)
            self._listening[name] = (server, f"http://{HOST}:{server.sockets[0].getsockname()[1]}")
        return self

    def url(self, name: str) -> str:
        return self._listening[name][1]

    @property
    def urls(self) -> list[str]:
        """Every server's URL, in the order they were named."""
        return [url for _, url in self._listening.values()]

    async def aclose(self) -> None:
        for server, _ in self._listening.values():
            server.close()
        tasks = [c.task for c in self._conns if c.task is not None]
        for conn in list(self._conns):
            if conn.transport is not None:
                conn.transport.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Script:
    """Records every ``/generate`` post and answers it from a per-server list of responders (each
    takes the body and returns an :class:`Answer`, or a coroutine of one); the last one answers
    every post after it. ``/abort_request`` is answered 200."""

    def __init__(self, **per_host: list[Callable[[dict], Any]]) -> None:
        self.per_host = {h: list(v) for h, v in per_host.items()}
        self.posts: list[tuple[str, dict]] = []

    async def __call__(self, request: Posted) -> Answer:
        if request.path == "/abort_request":
            return Answer(200)
        body = request.json()
        self.posts.append((request.host, body))
        todo = self.per_host[request.host]
        out = (todo.pop(0) if len(todo) > 1 else todo[0])(body)
        return await out if asyncio.iscoroutine(out) else out


Serve = Callable[..., Awaitable[Servers]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """``await serve(handler, "a", "b")``: servers named ``a`` and ``b`` answering through
    ``handler`` (a :class:`Script`, or any function of a :class:`Posted`); closed after the test.
    Without names, one per host of a :class:`Script`."""
    started: list[Servers] = []

    async def start(handler: Handler, *names: str) -> Servers:
        if not names and isinstance(handler, Script):
            names = tuple(handler.per_host)
        started.append(servers := await Servers(handler).start(*names))
        return servers

    try:
        yield start
    finally:
        for servers in started:
            with contextlib.suppress(Exception):  # teardown: a server that failed already
                await servers.aclose()
