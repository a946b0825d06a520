"""The wire to one inference server: POST a JSON body, get the status and the body back.

Production posts go through one shared aiohttp session (keep-alive connections, C HTTP parser):
it costs about a third of httpx's client CPU per ``/generate`` call, and its cost does not grow
with the number of connections (bench/RESULTS.md, "Rollout client"). Tests and embedders pass
an ``httpx`` transport instead (``httpx.MockTransport``); both raise :class:`WireError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp

if TYPE_CHECKING:
    import httpx

    from nodes.rollout.config import ClientConfig

__all__ = ["ServerPool", "Session", "WireError"]

_JSON = {"Content-Type": "application/json"}


class WireError(Exception):
    """The post did not get an HTTP answer (refused, reset, timed out): worth retrying.

    ``timed_out``: the request reached the server and may still run there (abort it there)."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class Session:
    """The aiohttp session every server's posts share, opened at the first post (aiohttp binds it
    to the running loop): up to ``max_connections_per_server`` keep-alive connections per server."""

    def __init__(self, cfg: ClientConfig) -> None:
        self._cfg = cfg
        self._session: aiohttp.ClientSession | None = None

    def get(self) -> aiohttp.ClientSession:
        if self._session is None:
            cfg = self._cfg
            connector = aiohttp.TCPConnector(
                limit=0,
                limit_per_host=cfg.max_connections_per_server,
                ttl_dns_cache=None,
                # SGLang's uvicorn closes a connection idle for 5 s: a post racing that close would fail
                keepalive_timeout=4.0,
            )
            # sock_connect bounds the TCP connect alone: a wait for a free connection is not a dead server
            timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, skip_auto_headers=("User-Agent",)
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class ServerPool:
    """One server: how to post to it, requests in flight there, and when it is next tried."""

    def __init__(
        self,
        url: str,
        cfg: ClientConfig,
        session: Session | None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """Posts go through ``session``, or through ``transport`` (httpx) when one is given."""
        self.url = url.rstrip("/")
        self._keys = cfg.keys  # each post carries the key its route needs (protocols.auth)
        self.inflight = 0
        self.down_until = 0.0
        self._session = session
        self._httpx: httpx.AsyncClient | None = None
        if transport is not None:
            import httpx

            self._httpx = httpx.AsyncClient(
                base_url=self.url,
                transport=transport,
                timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
            )

    def healthy(self, now: float) -> bool:
        return now >= self.down_until

    async def post(self, path: str, payload: bytes, timeout: float | None = None) -> tuple[int, bytes]:
        """POST ``payload`` (JSON bytes) to ``path``: (status, body). ``timeout`` (seconds) bounds
        the whole request instead of the client's request timeout."""
        if self._httpx is not None:
            return await self._post_httpx(path, payload, timeout)
        assert self._session is not None
        # aiohttp reads timeout=None as "no timeout": leave it out to keep the session's
        kw = {} if timeout is None else {"timeout": aiohttp.ClientTimeout(total=timeout)}
        try:
            headers = {**_JSON, **self._keys.headers(path)} if self._keys else _JSON
            async with self._session.get().post(self.url + path, data=payload, headers=headers, **kw) as r:
                return r.status, await r.read()
        except TimeoutError as e:  # before ClientError: aiohttp's timeouts are both
            # a connect that timed out never reached the server: nothing runs there to abort
            running = not isinstance(e, aiohttp.ConnectionTimeoutError)
            raise WireError(f"{type(e).__name__}: {e}", timed_out=running) from None
        except aiohttp.ClientError as e:  # refused, reset, closed mid-answer, bad HTTP
            raise WireError(f"{type(e).__name__}: {e}", timed_out=False) from None

    async def _post_httpx(self, path: str, payload: bytes, timeout: float | None) -> tuple[int, bytes]:
        import httpx

        assert self._httpx is not None
        try:
            headers = {**_JSON, **self._keys.headers(path)} if self._keys else _JSON
            r = await self._httpx.post(path, content=payload, headers=headers, timeout=timeout)
        except httpx.TransportError as e:
            raise WireError(f"{type(e).__name__}: {e}", isinstance(e, httpx.TimeoutException)) from None
        return r.status_code, r.content

    async def aclose(self) -> None:
        """Close this server's own connections (the shared session is the client's to close)."""
        if self._httpx is not None:
            await self._httpx.aclose()
