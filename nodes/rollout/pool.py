"""The wire to the inference servers: POST a JSON body, get the status and the body back.

One HTTP stack: per server, a pool of keep-alive connections over asyncio transports, answers
read by httptools' C parser (:class:`nodes.rollout.http1.ClientPool`). It costs the least client
CPU per ``/generate`` call of the libraries measured (aiohttp, httpx; bench/RESULTS.md, "Rollout
client"), and a rollout actor spends that CPU on the event loop its episodes run on. Everything
above the wire (routing, retries, failover, abort/resume, keys) is the client's.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from nodes.rollout.http1 import ClientError, ClientPool

if TYPE_CHECKING:
    from nodes.rollout.config import ClientConfig

__all__ = ["ServerPool", "Wire", "WireError"]

_JSON = {"Content-Type": "application/json"}
# SGLang's uvicorn closes a connection idle for 5 s: a post racing that close would fail
_KEEPALIVE_S = 4.0


class WireError(Exception):
    """The post did not get an HTTP answer (refused, reset, timed out): worth retrying.

    ``timed_out``: the request reached the server and may still run there (abort it there)."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class Wire:
    """Every server's connections, for one client: per server URL (``http://`` or ``https://``) a
    :class:`~nodes.rollout.http1.ClientPool` of up to ``max_connections_per_server`` keep-alive
    connections. ``connect_timeout_s`` bounds the TCP connect (and TLS handshake) alone,
    ``request_timeout_s`` the wait for the answer (for a stream, all of it)."""

    def __init__(self, cfg: ClientConfig) -> None:
        self._cfg = cfg
        self._pools: dict[str, tuple[ClientPool, str]] = {}  # url -> (pool, path prefix)
        self._tls: ssl.SSLContext | None = None  # one for every https server: building one reads the CAs

    def pool(self, url: str) -> tuple[ClientPool, str]:
        """``url``'s connection pool and path prefix (made at the first call); ValueError for a URL
        that is not ``http(s)://host[:port][/prefix]``."""
        if url not in self._pools:
            u = urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ValueError(f"server URL {url!r}: expected http://host[:port] or https://host[:port]")
            tls = None
            if u.scheme == "https":
                tls = self._tls = self._tls or ssl.create_default_context()
            pool = ClientPool(
                u.hostname,
                u.port or (443 if tls else 80),
                max_connections=self._cfg.max_connections_per_server,
                keepalive_s=_KEEPALIVE_S,
                connect_timeout_s=self._cfg.connect_timeout_s,
                ssl=tls,
            )
            self._pools[url] = (pool, u.path.rstrip("/"))
        return self._pools[url]

    async def post(
        self,
        url: str,
        path: str,
        payload: bytes,
        headers: Mapping[str, str],
        timeout: float | None = None,
        on_line: Callable[[bytes], None] | None = None,
    ) -> tuple[int, bytes]:
        """POST ``payload`` to ``url + path``: (status, body), or :class:`WireError`. ``timeout``
        (seconds) bounds this request instead of the client's request timeout. With ``on_line``,
        each line of a 200 event-stream answer goes there as it arrives and the body comes back
        empty; another answer (an error) comes back whole. When a stream stops short, ``on_line``
        has had what came, then :class:`WireError`."""
        pool, prefix = self.pool(url)
        limit = self._cfg.request_timeout_s if timeout is None else timeout
        try:
            return await pool.request("POST", prefix + path, payload, headers, limit, on_line)
        except ClientError as e:
            raise WireError(str(e), e.timed_out) from None

    async def aclose(self) -> None:
        """Close every connection."""
        for pool, _ in self._pools.values():
            pool.close()
        self._pools.clear()


class ServerPool:
    """One server: how to post to it, requests in flight there, and when it is next tried."""

    def __init__(self, url: str, cfg: ClientConfig, wire: Wire) -> None:
        """Posts go through ``wire``, the connections every server of a client shares."""
        self.url = url.rstrip("/")
        self._keys = cfg.keys  # each post carries the key its route needs (protocols.http.auth)
        self._wire = wire
        wire.pool(self.url)  # a bad URL fails here, when the client is made, not at its first post
        self.inflight = 0
        self.down_until = 0.0

    def healthy(self, now: float) -> bool:
        return now >= self.down_until

    async def post(self, path: str, payload: bytes, timeout: float | None = None) -> tuple[int, bytes]:
        """POST ``payload`` (JSON bytes) to ``path``: (status, body). ``timeout`` (seconds) bounds
        the whole request instead of the client's request timeout."""
        return await self._wire.post(self.url, path, payload, self._headers(path), timeout)

    async def post_stream(
        self, path: str, payload: bytes, on_line: Callable[[bytes], None]
    ) -> tuple[int, bytes]:
        """POST ``payload`` and hand each line of the event stream that answers to ``on_line``
        (:meth:`Wire.post`)."""
        return await self._wire.post(self.url, path, payload, self._headers(path), None, on_line)

    def _headers(self, path: str) -> Mapping[str, str]:
        return {**_JSON, **self._keys.headers(path)} if self._keys else _JSON
