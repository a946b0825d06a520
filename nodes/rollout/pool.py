"""The wire to the inference servers: POST a JSON body, get the status and the body back.

Three HTTP backends behind one small interface (:class:`HTTPBackend`), chosen by
``[rollout.client] http``; everything above the wire (routing, retries, failover, abort/resume,
keys) is the client's and the same for all:

- ``"httptools"`` (the default): our keep-alive connection pools over asyncio transports and
  httptools' C parser (nodes/rollout/http1.py). The least client CPU per ``/generate`` call of
  the three (bench/RESULTS.md, "Rollout client"). ``https://`` servers go through aiohttp.
- ``"aiohttp"``: one shared session, keep-alive connections, a C HTTP parser. It costs less
  client CPU per ``/generate`` call than httpx, and its cost does not grow with the number of
  connections.
- ``"httpx"`` (the design's client): per server, many small ``httpx.AsyncClient`` pools
  ("lanes"), since httpx's pool does work linear in its number of connections on every request.

Tests and embedders may pass an ``httpx`` transport (``httpx.MockTransport``) in place of the
network; that is the httpx backend. Both raise :class:`WireError` when no HTTP answer came.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from nodes.rollout.http1 import ClientError, ClientPool

if TYPE_CHECKING:
    import httpx

    from nodes.rollout.config import ClientConfig

__all__ = [
    "AiohttpBackend",
    "HTTPBackend",
    "HttptoolsBackend",
    "HttpxBackend",
    "ServerPool",
    "WireError",
    "open_backend",
]

_JSON = {"Content-Type": "application/json"}
# SGLang's uvicorn closes a connection idle for 5 s: a post racing that close would fail
_KEEPALIVE_S = 4.0


class WireError(Exception):
    """The post did not get an HTTP answer (refused, reset, timed out): worth retrying.

    ``timed_out``: the request reached the server and may still run there (abort it there)."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class HTTPBackend(Protocol):
    """How posts reach the servers: pooled keep-alive connections, the client's timeouts."""

    name: str  # the library: "httptools" | "aiohttp" | "httpx"

    async def post(
        self, url: str, path: str, payload: bytes, headers: Mapping[str, str], timeout: float | None
    ) -> tuple[int, bytes]:
        """POST ``payload`` to ``url + path``: (status, body), or :class:`WireError`. ``timeout``
        (seconds) bounds this request instead of the client's request timeout."""
        ...

    async def post_stream(
        self,
        url: str,
        path: str,
        payload: bytes,
        headers: Mapping[str, str],
        on_line: Callable[[bytes], None],
    ) -> tuple[int, bytes]:
        """POST ``payload`` and hand each line of an event-stream answer to ``on_line`` as it
        arrives: (status, b"") then; another answer (an error) is returned whole, as :meth:`post`.
        :class:`WireError` when the answer stops short (``on_line`` has had what came)."""
        ...

    async def aclose(self) -> None:
        """Close every connection."""
        ...


def _aiohttp_error(e: Exception) -> WireError:
    """aiohttp's failure as a WireError: refused, reset, closed mid-answer, bad HTTP, timeouts (a
    timeout is a TimeoutError and a ClientError both)."""
    # a connect that timed out never reached the server: nothing runs there to abort
    running = isinstance(e, TimeoutError) and not isinstance(e, aiohttp.ConnectionTimeoutError)
    return WireError(f"{type(e).__name__}: {e}", timed_out=running)


def _httpx_error(e: Exception) -> WireError:
    """httpx's TransportError as a WireError (refused, reset, closed mid-answer, bad HTTP, timeouts)."""
    import httpx

    # a connect that timed out, or a wait for a free connection, never reached the server
    running = isinstance(e, httpx.TimeoutException) and not isinstance(
        e, (httpx.ConnectTimeout, httpx.PoolTimeout)
    )
    return WireError(f"{type(e).__name__}: {e}", timed_out=running)


def open_backend(cfg: ClientConfig, transport: httpx.AsyncBaseTransport | None = None) -> HTTPBackend:
    """The backend ``cfg.http`` names; httpx over ``transport`` when one is given."""
    if transport is not None or cfg.http == "httpx":
        return HttpxBackend(cfg, transport)
    if cfg.http == "aiohttp":
        return AiohttpBackend(cfg)
    return HttptoolsBackend(cfg)


class HttptoolsBackend:
    """Per ``http://`` server, a :class:`~nodes.rollout.http1.ClientPool` of up to
    ``max_connections_per_server`` keep-alive connections; ``https://`` servers through aiohttp.
    ``connect_timeout_s`` bounds the TCP connect alone, ``request_timeout_s`` the wait for the
    answer (for a stream, all of it)."""

    name = "httptools"

    def __init__(self, cfg: ClientConfig) -> None:
        self._cfg = cfg
        self._pools: dict[str, tuple[ClientPool, str] | None] = {}  # url -> (pool, path prefix); None: https
        self._tls: AiohttpBackend | None = None

    def _pool(self, url: str) -> tuple[ClientPool, str] | None:
        if url not in self._pools:
            u = urlsplit(url)
            self._pools[url] = None if u.scheme != "http" or not u.hostname else (
                ClientPool(u.hostname, u.port or 80, max_connections=self._cfg.max_connections_per_server,
                           keepalive_s=_KEEPALIVE_S, connect_timeout_s=self._cfg.connect_timeout_s),
                u.path.rstrip("/"),
            )  # fmt: skip
        return self._pools[url]

    def _aiohttp(self) -> AiohttpBackend:
        if self._tls is None:
            self._tls = AiohttpBackend(self._cfg)
        return self._tls

    async def post(
        self, url: str, path: str, payload: bytes, headers: Mapping[str, str], timeout: float | None
    ) -> tuple[int, bytes]:
        return await self._send(url, path, payload, headers, timeout, None)

    async def post_stream(
        self,
        url: str,
        path: str,
        payload: bytes,
        headers: Mapping[str, str],
        on_line: Callable[[bytes], None],
    ) -> tuple[int, bytes]:
        return await self._send(url, path, payload, headers, None, on_line)

    async def _send(
        self, url: str, path: str, payload: bytes, headers: Mapping[str, str], timeout: float | None,
        on_line: Callable[[bytes], None] | None,
    ) -> tuple[int, bytes]:  # fmt: skip
        pool = self._pool(url)
        if pool is None:
            tls = self._aiohttp()
            if on_line is None:
                return await tls.post(url, path, payload, headers, timeout)
            return await tls.post_stream(url, path, payload, headers, on_line)
        limit = self._cfg.request_timeout_s if timeout is None else timeout
        try:
            return await pool[0].request("POST", pool[1] + path, payload, headers, limit, on_line)
        except ClientError as e:
            raise WireError(str(e), e.timed_out) from None

    async def aclose(self) -> None:
        for pool in self._pools.values():
            if pool is not None:
                pool[0].close()
        self._pools.clear()
        if self._tls is not None:
            await self._tls.aclose()


class AiohttpBackend:
    """One aiohttp session every server's posts share, opened at the first post (aiohttp binds it
    to the running loop): up to ``max_connections_per_server`` keep-alive connections per server."""

    name = "aiohttp"

    def __init__(self, cfg: ClientConfig) -> None:
        self._cfg = cfg
        self._session: aiohttp.ClientSession | None = None

    def _get(self) -> aiohttp.ClientSession:
        if self._session is None:
            cfg = self._cfg
            connector = aiohttp.TCPConnector(
                limit=0,
                limit_per_host=cfg.max_connections_per_server,
                ttl_dns_cache=None,
                keepalive_timeout=_KEEPALIVE_S,
            )
            # sock_connect bounds the TCP connect alone: a wait for a free connection is not a dead server
            timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, skip_auto_headers=("User-Agent",)
            )
        return self._session

    async def post(
        self, url: str, path: str, payload: bytes, headers: Mapping[str, str], timeout: float | None
    ) -> tuple[int, bytes]:
        # aiohttp reads timeout=None as "no timeout": leave it out to keep the session's
        kw = {} if timeout is None else {"timeout": aiohttp.ClientTimeout(total=timeout)}
        try:
            async with self._get().post(url + path, data=payload, headers=headers, **kw) as r:
                return r.status, await r.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _aiohttp_error(e) from None

    async def post_stream(
        self,
        url: str,
        path: str,
        payload: bytes,
        headers: Mapping[str, str],
        on_line: Callable[[bytes], None],
    ) -> tuple[int, bytes]:
        try:
            async with self._get().post(url + path, data=payload, headers=headers) as r:
                if r.status != 200 or r.content_type != "text/event-stream":
                    return r.status, await r.read()
                rest = b""  # lines of any length (StreamReader's own readline caps them at 128 KiB)
                async for data in r.content.iter_any():
                    *lines, rest = (rest + data).split(b"\n")
                    for line in lines:
                        on_line(line)
                if rest:
                    on_line(rest)
                return r.status, b""
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _aiohttp_error(e) from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _Lane:
    """One httpx.AsyncClient with a small pool, and the posts it carries now."""

    __slots__ = ("http", "inflight")

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.inflight = 0


class HttpxBackend:
    """Per server, lanes of ``LANE`` connections each, up to ``max_connections_per_server`` in all:
    a post takes the first lane with a free connection, opens a lane when all are busy, and queues
    on the least busy one at the cap. httpx's pool scans its connections on every request; at 256
    requests in flight, small pools cost a tenth of one large pool's CPU per call.

    Timeouts as aiohttp's: ``connect_timeout_s`` bounds the TCP connect alone;
    ``request_timeout_s`` bounds each wait for the server (httpx times each read, write and wait
    for a connection rather than the whole request; a ``/generate`` answer is one read)."""

    name = "httpx"
    LANE = 4

    def __init__(self, cfg: ClientConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        import httpx

        self._cfg = cfg
        self._transport = transport
        self._timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        self._limits = httpx.Limits(
            max_connections=self.LANE, max_keepalive_connections=self.LANE, keepalive_expiry=_KEEPALIVE_S
        )
        self._max_lanes = max(1, cfg.max_connections_per_server // self.LANE)
        self._lanes: dict[str, list[_Lane]] = {}
        self._ssl: Any = None  # one context for every lane: building one loads the CA bundle, which is slow

    def _take(self, url: str) -> _Lane:
        lanes = self._lanes.setdefault(url, [])
        lane = next((ln for ln in lanes if ln.inflight < self.LANE), None)
        if lane is None:
            if len(lanes) < self._max_lanes:
                import httpx

                if url.startswith("https") and self._ssl is None:
                    self._ssl = httpx.create_ssl_context()
                lane = _Lane(httpx.AsyncClient(
                    base_url=url, transport=self._transport, verify=self._ssl if url.startswith("https") else False,
                    timeout=self._timeout, limits=self._limits,
                ))  # fmt: skip
                lanes.append(lane)
            else:
                lane = min(lanes, key=lambda ln: ln.inflight)
        lane.inflight += 1
        return lane

    async def post(
        self, url: str, path: str, payload: bytes, headers: Mapping[str, str], timeout: float | None
    ) -> tuple[int, bytes]:
        import httpx

        lane = self._take(url)
        try:
            kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
            r = await lane.http.post(path, content=payload, headers=headers, **kw)
        except httpx.TransportError as e:
            raise _httpx_error(e) from None
        finally:
            lane.inflight -= 1
        return r.status_code, r.content

    async def post_stream(
        self,
        url: str,
        path: str,
        payload: bytes,
        headers: Mapping[str, str],
        on_line: Callable[[bytes], None],
    ) -> tuple[int, bytes]:
        import httpx

        lane = self._take(url)
        try:
            async with lane.http.stream("POST", path, content=payload, headers=headers) as r:
                if r.status_code != 200 or not r.headers.get("content-type", "").startswith(
                    "text/event-stream"
                ):
                    return r.status_code, await r.aread()
                async for line in r.aiter_lines():
                    on_line(line.encode())
                return r.status_code, b""
        except httpx.TransportError as e:
            raise _httpx_error(e) from None
        finally:
            lane.inflight -= 1

    async def aclose(self) -> None:
        lanes = [ln for per_server in self._lanes.values() for ln in per_server]
        self._lanes.clear()
        await asyncio.gather(*(ln.http.aclose() for ln in lanes))


class ServerPool:
    """One server: how to post to it, requests in flight there, and when it is next tried."""

    def __init__(self, url: str, cfg: ClientConfig, http: HTTPBackend) -> None:
        """Posts go through ``http``, the backend every server of a client shares."""
        self.url = url.rstrip("/")
        self._keys = cfg.keys  # each post carries the key its route needs (protocols.auth)
        self._http = http
        self.inflight = 0
        self.down_until = 0.0

    def healthy(self, now: float) -> bool:
        return now >= self.down_until

    async def post(self, path: str, payload: bytes, timeout: float | None = None) -> tuple[int, bytes]:
        """POST ``payload`` (JSON bytes) to ``path``: (status, body). ``timeout`` (seconds) bounds
        the whole request instead of the client's request timeout."""
        return await self._http.post(self.url, path, payload, self._headers(path), timeout)

    async def post_stream(
        self, path: str, payload: bytes, on_line: Callable[[bytes], None]
    ) -> tuple[int, bytes]:
        """POST ``payload`` and hand each line of the event stream that answers to ``on_line``
        (:meth:`HTTPBackend.post_stream`)."""
        return await self._http.post_stream(self.url, path, payload, self._headers(path), on_line)

    def _headers(self, path: str) -> Mapping[str, str]:
        return {**_JSON, **self._keys.headers(path)} if self._keys else _JSON
