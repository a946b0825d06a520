"""A client of another model's servers (``[models.<name>]``: a teacher, a judge, a reward model).

Those servers belong to a pool of their own (nodes/inference/pool.py, one actor per model, named
by :func:`~nodes.inference.pool.pool_name`), started with the run, replaced when they die and never
pushed weights. A rollout actor calls them as part of an episode through a :class:`ModelClient`:
each call goes to the server with the fewest calls in flight; a server that fails a call (no
answer, or a 5xx) is set aside for ``down_cooldown_s`` and the call moves to another; when none is
left the client asks the pool for its live servers again (a replacement has a new URL), and
waits for one within the call's timeout: a teacher's server that dies delays the episodes that
need it rather than failing them. The
wire is the rollout client's (nodes/rollout/pool.py), so the same keys and timeouts apply.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import structlog

from nodes.rollout.config import ClientConfig
from nodes.rollout.pool import ServerPool, Wire, WireError

__all__ = ["ModelCallError", "ModelClient", "bind_model", "model_servers"]

log = structlog.get_logger(__name__)

REFRESH_S = 1.0  # while a model has no server that answers, the pool is asked again this often


class ModelCallError(RuntimeError):
    """A call to a model's servers failed on every server (or was refused with a 4xx)."""


_BOUND: dict[str, Any] = {}  # model name -> its pool (or URLs), where this process was told


def bind_model(name: str, servers: Any) -> None:
    """Tell this process where model ``name``'s servers are (its pool's handle, or URLs): for a
    process that is no actor of the run, such as the driver, whose evaluation scores with a judge."""
    _BOUND[name] = servers


async def model_servers(name: str) -> Any:
    """Where model ``name``'s servers are: what :func:`bind_model` was told, else (in an actor of
    the run) the model's pool actor, ``inference-pool-<name>``."""
    if name in _BOUND:
        return _BOUND[name]
    import rlactors

    try:
        cluster = rlactors.get_context().cluster
    except rlactors.ClusterError:
        raise ModelCallError(
            f"model '{name}': this process is no actor of the run and was not told where its servers are "
            "(nodes.rollout.models.bind_model)"
        ) from None
    return await cluster.get_actor(f"inference-pool-{name}")


class ModelClient:
    """Calls to one model's servers. ``servers`` is the model's pool actor (a handle whose
    ``urls()`` lists the live servers), a fixed list of URLs, or None: found at the first call
    (:func:`model_servers`)."""

    def __init__(self, name: str, servers: Any = None, config: ClientConfig | None = None) -> None:
        self.name = name
        self.config = config or ClientConfig()
        self._pool = None if isinstance(servers, list) else servers
        self._find = servers is None
        self._wire = Wire(self.config)
        self._servers: dict[str, ServerPool] = {}
        self._refreshing: asyncio.Lock | None = None
        self.calls = 0
        if isinstance(servers, list):
            self._set_urls(servers)

    def _set_urls(self, urls: list[str]) -> None:
        urls = [u.rstrip("/") for u in urls]
        for u in list(self._servers):
            if u not in urls:
                del self._servers[u]
        for u in urls:
            if u not in self._servers:
                self._servers[u] = ServerPool(u, self.config, self._wire)

    async def refresh(self) -> list[str]:
        """Ask the pool for its live servers (a fixed list stays as it is)."""
        if self._find:  # the first call: where the model's servers are
            found = await model_servers(self.name)
            self._find = False
            if isinstance(found, list):
                self._set_urls(found)
            else:
                self._pool = found
        if self._pool is not None:
            self._refreshing = self._refreshing or asyncio.Lock()
            async with self._refreshing:
                self._set_urls(list(await self._pool.urls()))
        return list(self._servers)

    def _pick(self, tried: set[str]) -> ServerPool | None:
        now = time.monotonic()
        ready = [s for u, s in self._servers.items() if u not in tried and s.healthy(now)]
        return min(ready, key=lambda s: s.inflight) if ready else None

    async def post(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> Any:
        """POST ``body`` (JSON) to ``path`` on one of the model's servers; the decoded answer.

        A server that does not answer or answers 5xx is set aside and the call moves to another;
        with none left the pool is asked for its live servers again, and again each
        ``REFRESH_S`` while it has none (a dead server's replacement is starting), until
        ``timeout_s`` (default: the client's request timeout). :class:`ModelCallError` past that,
        or at once for a 4xx (the same call would fail anywhere)."""
        limit = self.config.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        payload = orjson.dumps(body)
        tried: set[str] = set()
        last = "no server"
        while (left := deadline - time.monotonic()) > 0:
            server = self._pick(tried)
            if server is None:  # every server tried or set aside: ask the pool, then wait for one
                await self.refresh()
                tried.clear()
                if self._pick(tried) is None:
                    await asyncio.sleep(min(REFRESH_S, max(left, 0.0)))  # nothing to wait on but the pool
                continue
            tried.add(server.url)
            server.inflight += 1
            self.calls += 1
            try:
                status, content = await server.post(path, payload, left)
            except WireError as e:
                last = f"{server.url}: {e}"
                server.down_until = time.monotonic() + self.config.down_cooldown_s
                continue
            finally:
                server.inflight -= 1
            if status >= 500:
                last = f"{server.url}{path} answered {status}: {content[:200]!r}"
                server.down_until = time.monotonic() + self.config.down_cooldown_s
                continue
            if status != 200:
                raise ModelCallError(
                    f"model '{self.name}': {server.url}{path} answered {status}: {content[:500]!r}"
                )
            return orjson.loads(content)
        raise ModelCallError(
            f"model '{self.name}': no server answered {path} within {limit:g} s; last: {last}"
        )

    async def aclose(self) -> None:
        """Close the connections."""
        await self._wire.aclose()
