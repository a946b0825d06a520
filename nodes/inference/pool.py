"""The inference pool: one named actor per model that owns the set of its inference servers.

The policy's pool (``inference-pool``) serves the rollout and takes weight pushes. Every other
model of a run (``[models.<name>]``: a teacher, a judge) has a pool of the same class
(``inference-pool-<name>``, :func:`pool_name`) with ``PoolConfig.pushed = False``: its servers are
started with the run, placed, health-checked and replaced the same way, but never pushed weights,
so a server goes ``live`` as soon as it is healthy and ``leaving`` ends when it has drained.

The policy's servers join, leave and die during a run; the pool keeps the set and its states, and
:class:`~nodes.driver.policy_sync.PolicySync` applies them at each publish:

- ``joining``: running and healthy, not yet serving. At the next publish the weight-update group
  is re-formed with it, the push gives it the current weights, and once it reports the published
  ``weight_version`` it becomes ``live`` and the rollout actors route to it (:meth:`settle`).
- ``live``: in the group and in the rollout actors' routing.
- ``leaving``: removed; the rollout actors stopped sending to it at once, its running requests
  finish (or, past ``drain_timeout_s`` or when it stops, are aborted and resumed elsewhere with
  their tokens, as failover does). The next publish re-forms the group without it, and a server
  the pool launched is then stopped.

A server that stops answering ``/health`` is dropped; with ``replace_dead`` one the pool launched
is launched again on its node (at most ``max_replacements`` times in all) and joins as above.
The policy's pool reports the other models' pools too (:meth:`InferencePool.attach_models`), so
``rlactors pool ls`` shows every model's servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import httpx  # the pool's health and load checks: a call per server per check, not /generate's wire
import structlog

import rlactors
from nodes.inference.launcher import (
    InferenceServerActor,
    ReferenceServerConfig,
    SGLangServerConfig,
    cluster_keys,
)
from protocols.http.auth import ServerKeys
from protocols.runtime.codec import register
from rlactors.base.aio import wait_for

__all__ = ["POOL_NAME", "InferencePool", "Member", "PoolConfig", "pool_name"]

log = structlog.get_logger(__name__)

POOL_NAME = "inference-pool"


def pool_name(model: str = "") -> str:
    """The pool actor's name of ``model`` (a ``[models.<name>]`` table); the policy's without one."""
    return f"{POOL_NAME}-{model}" if model else POOL_NAME


@register
@dataclass
class PoolConfig:
    """How the pool launches servers and watches them."""

    server: ReferenceServerConfig | SGLangServerConfig = field(default_factory=ReferenceServerConfig)
    env: dict[str, str] = field(default_factory=dict)  # the server worker's environment
    gpus_per_server: int = 0
    startup_timeout_s: float = 600.0
    log_dir: str = ""  # server-<i>.log here ("" = no log)
    replace_dead: bool = True
    max_replacements: int = 3  # relaunches of dead servers, over the whole run
    health_every_s: float = 1.0
    # consecutive failed /health probes before a server counts as dead; SGLang's /health runs a
    # one-token generation and may take seconds under load, so a probe waits health_timeout_s
    dead_after: int = 2
    health_timeout_s: float = 40.0
    drain_timeout_s: float = 120.0  # a removed server's requests may run this long before it stops
    # the model's name ("" = the policy): its servers are "<model>-server-<i>"
    model: str = ""
    # the policy's pool: servers join at a weight publish. False: a model never pushed to (teacher,
    # judge): a server is live once healthy, and one removed stops once drained
    pushed: bool = True


@register
@dataclass
class Member:
    """One server of the pool."""

    url: str
    state: str  # joining | live | leaving
    launched: bool  # started by the pool (stopped by it when it leaves or dies)
    name: str = ""  # its InferenceServerActor's name, if launched
    node_id: str = ""
    version: int = -1  # the policy version it was checked to serve when it went live
    since: float = 0.0  # when it entered its state (wall clock)


class InferencePool(rlactors.Actor):
    """The server set of a run (see the module docstring). ``rollouts`` are told at once when a
    server must stop getting requests; :meth:`attach` sets them once they exist. It spawns its
    servers' actors, so spawn it with ``control=True`` (the control credential)."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.members: dict[str, Member] = {}
        self.actors: dict[str, Any] = {}  # url -> InferenceServerActor handle (launched ones)
        self.rollouts: list[Any] = []
        self.models: dict[str, Any] = {}  # the other models' pools (the policy's pool reports them)
        self.replacements = 0
        self.events: list[str] = []  # what happened, for the driver's report (drained by plan())
        self._next = 0  # the next server-<i> index
        self._misses: dict[str, int] = {}
        self._watch: asyncio.Task[None] | None = None
        self._http: httpx.AsyncClient | None = None
        self._keys: ServerKeys | None = None

    async def on_start(self) -> None:
        # the servers' keys (the cluster's pair): /v1/loads needs one when they take keys
        keys = self._keys = await cluster_keys(rlactors.get_context().cluster)
        self._http = httpx.AsyncClient(timeout=self.config.health_timeout_s, auth=keys)
        self._watch = asyncio.create_task(self._watch_health(), name="pool-health")

    async def on_stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await asyncio.gather(*(self._stop(u) for u in list(self.actors)), return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()

    # -- the public API ------------------------------------------------------------------------

    async def start(self, n: int) -> list[str]:
        """Launch the run's first ``n`` servers, live at once: the policy's start with the base
        weights, which are policy version 0, and join the group when it is first formed."""
        urls = await self._launch(n, None)
        for u in urls:
            self._set(u, "live", version=0 if self.config.pushed else None)
        return urls

    def attach(self, rollouts: list[Any]) -> None:
        """The rollout actors (handles) to tell when a server must get no new requests."""
        self.rollouts = list(rollouts)

    def attach_models(self, pools: dict[str, Any]) -> None:
        """The other models' pools (handles by model name), reported by :meth:`status`."""
        self.models = dict(pools)

    async def add(self, url: str) -> dict[str, Any]:
        """Take a server already running at ``url`` (SGLang or ours); it serves from the next publish."""
        url = url.rstrip("/")
        if url in self.members:
            return self._row(self.members[url])
        if not await self._healthy(url):
            raise ValueError(f"{url}/health does not answer 200: start the server first, or check the URL")
        self.members[url] = Member(url, self._new_state, launched=False, since=time.time())
        self._event(f"server added: {url} ({self._joins})")
        return self._row(self.members[url])

    async def launch(self, n: int = 1, node: str | None = None) -> list[str]:
        """Start ``n`` servers with the configured launcher (on ``node``, or where resources are
        free); they serve from the next publish."""
        urls = await self._launch(n, node)
        self._event(f"servers launched: {urls} ({self._joins})")
        return urls

    async def remove(self, url: str, drain: bool = True) -> dict[str, Any]:
        """Stop routing to ``url`` now; with ``drain`` wait (up to ``drain_timeout_s``) until its
        running requests finished. It leaves the weight-update group at the next publish."""
        url = url.rstrip("/")
        m = self.members.get(url)
        if m is None:
            raise KeyError(f"{url} is not in the pool; `rlactors pool ls` lists its servers")
        if m.state == "joining":  # never served: nothing to drain
            await self._forget(url)
            self._event(f"server removed before joining: {url}")
            return {"url": url, "state": "removed"}
        if m.state == "live" and len([x for x in self.members.values() if x.state == "live"]) == 1:
            raise ValueError(f"{url} is the last live server: add or launch another before removing it")
        self._set(url, "leaving")
        await self._retire(url)
        self._event(f"server leaving: {url}")
        if drain:
            await self._drained(url, self.config.drain_timeout_s)
        if not self.config.pushed:  # no publish to wait for: it is done with once drained
            row = self._row(m)
            await self._forget(url)
            return {**row, "state": "removed"}
        return self._row(m)

    def urls(self) -> list[str]:
        """The live servers (those the rollout actors route to)."""
        return [u for u, m in self.members.items() if m.state == "live"]

    async def status(self) -> dict[str, Any]:
        """Every server with its state, and the pool's counters; the policy's pool adds each other
        model's status under ``models``."""
        out: dict[str, Any] = {
            "model": self.config.model,
            "servers": [self._row(m) for m in self.members.values()],
            "replacements": self.replacements,
            "max_replacements": self.config.max_replacements if self.config.replace_dead else 0,
        }
        if self.models:
            names = list(self.models)
            answers = await asyncio.gather(*(self.models[n].status() for n in names), return_exceptions=True)
            out["models"] = {
                n: a if not isinstance(a, BaseException) else {"error": str(a)}
                for n, a in zip(names, answers, strict=True)
            }
        return out

    # -- for PolicySync ------------------------------------------------------------------------

    def plan(self) -> dict[str, Any]:
        """What the next publish applies: ``live`` and ``joining`` servers (the group is formed
        with both), and the events since the last plan."""
        events, self.events = self.events, []
        return {
            "live": [u for u, m in self.members.items() if m.state == "live"],
            "joining": [u for u, m in self.members.items() if m.state == "joining"],
            "events": events,
        }

    async def settle(self, version: int, joined: list[str], group: list[str]) -> None:
        """After a publish of ``version``: ``joined`` reported it and are now live; leaving servers
        outside the weight-update ``group`` are done with and (if launched) stopped."""
        for u in joined:
            if u in self.members and self.members[u].state == "joining":
                self._set(u, "live", version=version)
        done = [u for u, m in self.members.items() if m.state == "leaving" and u not in group]
        await asyncio.gather(*(self._forget(u) for u in done))

    # -- internals -----------------------------------------------------------------------------

    async def _launch(self, n: int, node: str | None) -> list[str]:
        cluster = rlactors.get_context().cluster
        c = self.config
        prefix = f"{c.model}-server" if c.model else "server"
        names = [f"{prefix}-{self._next + i}" for i in range(n)]
        self._next += n
        handles = [
            await cluster.spawn(
                InferenceServerActor,
                c.server,
                env=c.env,  # the worker's environment; the server process inherits it
                startup_timeout_s=c.startup_timeout_s,
                # a server restarted in place would come back with base weights, unseen: the pool
                # replaces it instead, and the replacement joins with the current weights
                server_max_restarts=0,
                name=name,
                log_path=f"{c.log_dir}/{name}.log" if c.log_dir else None,
                keys=self._keys,  # the servers' own workers may not read the secret key
                resources={"gpu": c.gpus_per_server},
                node_id=node,
            )
            for name in names
        ]
        urls = list(await asyncio.gather(*(h.url() for h in handles)))
        for name, h, u in zip(names, handles, urls, strict=True):
            self.actors[u] = h
            node_id = await cluster.node_of(h)
            self.members[u] = Member(
                u, self._new_state, launched=True, name=name, node_id=node_id, since=time.time()
            )
        return urls

    @property
    def _new_state(self) -> str:
        """A new server's state: the policy's join at the next publish, other models' serve at once."""
        return "joining" if self.config.pushed else "live"

    @property
    def _joins(self) -> str:
        return "joins at the next publish" if self.config.pushed else "serving"

    def _set(self, url: str, state: str, version: int | None = None) -> None:
        m = self.members[url]
        m.state, m.since = state, time.time()
        if version is not None:
            m.version = version
        log.info(
            "pool.server_state",
            model=self.config.model or "policy",
            server=url,
            state=state,
            version=m.version,
        )

    def _row(self, m: Member) -> dict[str, Any]:
        return {
            "url": m.url,
            "state": m.state,
            "launched": m.launched,
            "name": m.name,
            "node": m.node_id,
            "version": m.version,
            "since": m.since,
        }

    def _event(self, line: str) -> None:
        log.info("pool.event", what=line)
        self.events.append(line)

    async def _retire(self, url: str) -> None:
        """Tell every rollout actor to stop sending ``url`` new requests (a restarted one learns it
        at the next publish, which names the live servers)."""
        results = await asyncio.gather(*(r.retire_server(url) for r in self.rollouts), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.warning("pool.retire_failed", server=url, error=str(r))

    async def _drained(self, url: str, timeout_s: float) -> bool:
        """Wait until ``url`` runs and queues no request (its ``/v1/loads``), or ``timeout_s``."""
        assert self._http is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                loads = (await self._http.get(f"{url}/v1/loads")).json()["loads"]
                if all(x["num_running_reqs"] == 0 and x["num_waiting_reqs"] == 0 for x in loads):
                    return True
            except (httpx.HTTPError, KeyError, ValueError):
                return True  # gone: its requests fail over
            await asyncio.sleep(0.2)  # polling the server's load; nothing to wait on instead
        log.warning("pool.drain_timeout", server=url, timeout_s=timeout_s)
        return False

    async def _forget(self, url: str) -> None:
        self.members.pop(url, None)
        self._misses.pop(url, None)
        await self._stop(url)

    async def _stop(self, url: str) -> None:
        h = self.actors.pop(url, None)
        if h is None:
            return
        try:
            await wait_for(h.stop(), 30)
        except Exception as e:  # dead already
            log.info("pool.stop_failed", server=url, error=str(e))
        with contextlib.suppress(Exception):  # best effort: the worker may be gone already
            await rlactors.get_context().cluster.kill(h)

    async def _healthy(self, url: str) -> bool:
        assert self._http is not None
        try:
            return (await self._http.get(f"{url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_every_s)  # the probe period
            urls = [u for u, m in self.members.items() if m.state in ("live", "joining")]
            answers = await asyncio.gather(*(self._healthy(u) for u in urls))
            for url, ok in zip(urls, answers, strict=True):
                self._misses[url] = 0 if ok else self._misses.get(url, 0) + 1
                if self._misses[url] >= self.config.dead_after and url in self.members:
                    try:
                        await self._replace(url)
                    except Exception as e:  # keep watching the others
                        log.error("pool.replace_failed", server=url, error=str(e))
                        self._event(f"server {url} died; replacing it failed: {e}")

    async def _replace(self, url: str) -> None:
        m = self.members[url]
        await self._retire(url)
        await self._forget(url)
        c = self.config
        if not (m.launched and c.replace_dead and self.replacements < c.max_replacements):
            self._event(f"servers down: {[url]} (not replaced)")
            return
        self.replacements += 1
        self._event(f"servers down: {[url]}; launching a replacement on {m.node_id or 'any node'}")
        urls = await self._launch(1, m.node_id or None)
        self._event(f"replacement for {url}: {urls[0]} ({self._joins})")
