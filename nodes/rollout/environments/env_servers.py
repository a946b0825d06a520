"""The OpenEnv servers an episode uses: servers already running (``env_urls``), or servers the run
starts from an app (``env_app``), each an actor placed by the runtime like any other.

A started server is an :class:`EnvServerActor` named ``env-0``, ``env-1``, ... (``n_envs`` of them
for the run, spawned by the driver before the rollout actors: :func:`start_env_servers`). The actor
owns one ``uvicorn <env_app>`` process on its node, checks ``/health`` until it answers, then
watches it: when the process exits, or ``/health`` fails ``DEAD_AFTER`` probes in a row, the actor
ends its own worker and the runtime replaces it (the actor's ``max_restarts``: a fresh incarnation
starting a fresh server), as the inference pool replaces a dead server with a new actor. The
server dies with its actor however the actor ends, and the run's end stops the actors: nothing is
left behind.

The episodes (:class:`EnvServers`, in the rollout actors and the run's evaluation) learn the
servers' URLs from the actors, round robin, and ask again after an episode failed on one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import sys
import time
from typing import Any, Protocol

import httpx  # the environment servers' client: another role than the inference servers' wire
import structlog

import rlactors
from nodes.common.procs import HOLD_SIGTERM, child_setup, free_port, stop_process_group
from nodes.rollout.environments.episodes import EnvError
from rlactors.base.aio import wait_for
from rlactors.wire.runtime import current_client

__all__ = ["ENV_ACTOR", "EnvServerActor", "EnvServers", "ServerSettings", "health", "start_env_servers"]

log = structlog.get_logger(__name__)

ENV_ACTOR = "env"  # started servers' actors: env-0, env-1, ...
HEALTH_TIMEOUT_S = 5.0  # one /health probe
HEALTH_EVERY_S = 5.0  # a started server's probe period
DEAD_AFTER = 3  # failed probes in a row before a started server counts as dead


class ServerSettings(Protocol):
    """What this module reads of an ``OpenEnvConfig`` (nodes/rollout/environments/openenv_env.py)."""

    # properties: a settings class may compute them (VerifiersV1Config does) or hold them as fields

    @property
    def env_urls(self) -> list[str]: ...
    @property
    def env_app(self) -> str: ...
    @property
    def n_envs(self) -> int: ...
    @property
    def max_replacements(self) -> int: ...
    @property
    def start_timeout_s(self) -> float: ...


async def health(url: str, client: httpx.AsyncClient | None = None) -> str | None:
    """None when ``url``'s ``/health`` answers 200, else why not (one line)."""
    try:
        if client is None:
            async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S) as c:
                r = await c.get(url.rstrip("/") + "/health")
        else:
            r = await client.get(url.rstrip("/") + "/health")
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    return None if r.status_code == 200 else f"/health answered {r.status_code}"


class EnvServerActor(rlactors.Actor):
    """One OpenEnv server of ``app`` (``module:app``) on this actor's node; see the module docstring.
    Its worker exits when the server has died, so that the runtime replaces the actor.

    A server may be several processes (a verifiers v1 environment's: its env server and the bridge
    in front of it, nodes/rollout/environments/verifiers_v1.py): :meth:`commands` says which; one
    ending is the server's death."""

    label = "OpenEnv server"  # how logs and errors name the server

    def __init__(self, app: str, start_timeout_s: float = 120.0) -> None:
        self.app, self.start_timeout_s = app, start_timeout_s
        self.proc: asyncio.subprocess.Process | None = None  # the process that answers /health
        self.procs: list[asyncio.subprocess.Process] = []  # all of the server's, self.proc among them
        self._started: asyncio.Task[str] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    async def on_start(self) -> None:
        self._started = asyncio.create_task(self._start(), name="env-server-start")

    async def on_stop(self) -> None:
        self._stopping = True
        for task in (self._watch, self._started):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self._kill()

    async def url(self) -> str:
        """The server's base URL, once it answers ``/health`` (raises if it did not start).

        Never a dead server's: a caller asks again after an episode failed on the server, which may
        have died a moment ago, before this worker's loop saw its process end. So one ``/health``
        probe first; when it fails and the process has ended, the watcher ends this worker, and the
        caller's call fails with ``ActorDiedError`` and reaches the next incarnation's server."""
        assert self._started is not None
        url = await asyncio.shield(self._started)
        assert self.proc is not None
        if not self._ended() and await health(url) is not None:
            with contextlib.suppress(TimeoutError):  # dead, or only slow: the processes say which
                await wait_for(asyncio.shield(self._any_exit()), HEALTH_TIMEOUT_S)
        if self._ended() and not self._stopping:
            await asyncio.Event().wait()  # until the watcher's os._exit: this URL is not to be used
        return url

    async def pid(self) -> int:
        """The server process's pid."""
        await self.url()
        assert self.proc is not None
        return self.proc.pid

    def commands(self, host: str, port: int) -> tuple[list[list[str]], dict[str, str]]:
        """The server's processes (the last answers ``/health`` on ``host:port``) and what their
        environment adds: here one ``uvicorn <app>``."""
        return [
            [
                sys.executable,
                "-m",
                "uvicorn",
                self.app,
                "--host",
                host,
                "--port",
                str(port),
                "--log-level",
                "warning",
            ]
        ], {}

    def _ended(self) -> bool:
        return any(p.returncode is not None for p in self.procs)

    async def _any_exit(self) -> None:
        waits = [asyncio.ensure_future(p.wait()) for p in self.procs]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _start(self) -> str:
        host = await _node_host()
        port = free_port(host)
        cmds, env = self.commands(host, port)
        for cmd in cmds:
            # its own session, SIGTERM held, killed when this worker dies: as an inference server
            self.procs.append(
                await asyncio.create_subprocess_exec(
                    *HOLD_SIGTERM,
                    *cmd,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                    preexec_fn=functools.partial(child_setup, os.getpid()),
                    env={**os.environ, **env},
                )
            )
        self.proc = self.procs[-1]
        url = f"http://{host}:{port}"
        deadline = time.monotonic() + self.start_timeout_s
        async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S) as client:
            while (why := await health(url, client)) is not None:
                if self._ended() or time.monotonic() > deadline:
                    await self._kill()
                    codes = [p.returncode for p in self.procs]
                    raise RuntimeError(f"{self.label} {self.app} did not start ({why}; exit {codes})")
                await asyncio.sleep(0.2)  # polling a starting process: nothing to wait on but its port
        log.info(
            "env.server_started", server=self.label, app=self.app, url=url, pids=[p.pid for p in self.procs]
        )
        self._watch = asyncio.create_task(self._watch_server(url), name="env-server-watch")
        return url

    async def _watch_server(self, url: str) -> None:
        """End this worker when the server's process exits or stops answering ``/health``."""
        assert self.proc is not None
        misses, why = 0, ""
        async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S) as client:
            while misses < DEAD_AFTER:
                with contextlib.suppress(TimeoutError):
                    await wait_for(asyncio.shield(self._any_exit()), HEALTH_EVERY_S)  # the probe period
                if self._ended():
                    why = f"its processes exited ({[p.returncode for p in self.procs]})"
                    break
                if (failed := await health(url, client)) is None:
                    misses = 0
                else:
                    misses, why = misses + 1, f"/health failed {DEAD_AFTER} times: {failed}"
        if self._stopping:
            return
        log.warning("env.server_died", server=self.label, app=self.app, url=url, why=why)
        await self._kill()
        os._exit(1)  # the runtime replaces this actor: a fresh incarnation, a fresh server

    async def _kill(self) -> None:
        """:func:`~nodes.common.procs.stop_process_group` of the server's processes."""
        await asyncio.gather(*(stop_process_group(p, 5.0) for p in self.procs if p.returncode is None))


async def _node_host() -> str:
    """The address this actor's node registered with (others reach the server by it)."""
    ctx = rlactors.get_context()
    for node in await ctx.cluster.nodes():
        if node["node_id"] == ctx.node_id:
            return str(node["host"])
    return "127.0.0.1"


async def start_env_servers(
    cluster: rlactors.Cluster,
    config: ServerSettings,
    actor: type[EnvServerActor] = EnvServerActor,
    *args: Any,
) -> list[str]:
    """Spawn the run's ``n_envs`` ``actor`` (:class:`EnvServerActor`) of ``env_app`` (``env-0``, ...),
    each replaced up to ``max_replacements`` times when its server dies; their URLs once all answer.
    ``args`` follow ``start_timeout_s`` in the actor's arguments."""
    c = config
    spawn = functools.partial(cluster.spawn, actor, c.env_app, c.start_timeout_s, *args)
    handles = [await spawn(name=f"{ENV_ACTOR}-{i}", max_restarts=c.max_replacements) for i in range(c.n_envs)]
    try:
        return list(await asyncio.gather(*(wait_for(h.url(), config.start_timeout_s + 10) for h in handles)))
    except (rlactors.RemoteError, TimeoutError) as e:
        raise RuntimeError(f"{actor.label} {c.env_app!r} did not start: {e}") from None


class EnvServers:
    """The OpenEnv servers of a workflow's episodes, round robin: the given ``env_urls``, or the
    URLs of the run's started servers, asked of their actors (again after an episode failed on one)."""

    def __init__(self, config: ServerSettings) -> None:
        self.config = config
        self.names = [] if config.env_urls else [f"{ENV_ACTOR}-{i}" for i in range(config.n_envs)]
        self.urls: dict[str, str] = {}  # actor name -> its server's URL, as last asked
        self._next = itertools.count()

    async def pick(self) -> str:
        """A server's URL for a new episode."""
        if self.config.env_urls:
            return self.config.env_urls[next(self._next) % len(self.config.env_urls)]
        name = self.names[next(self._next) % len(self.names)]
        if name not in self.urls:
            self.urls[name] = await self._ask(name)
        return self.urls[name]

    def failed(self, url: str) -> None:
        """An episode failed on ``url``: ask its actor again next time (it may have been replaced)."""
        for name in [n for n, u in self.urls.items() if u == url]:
            del self.urls[name]

    async def _ask(self, name: str) -> str:
        """The URL of ``name``'s server, waiting out a replacement (within ``start_timeout_s``)."""
        try:
            cluster = rlactors.Cluster(current_client())  # an actor's, or the driver's (its evaluation)
        except rlactors.ClusterError:
            raise EnvError(
                f"env_app = {self.config.env_app!r}: its servers are started by a run; outside one, "
                "start the server and name it in env_urls"
            ) from None
        try:
            async with asyncio.timeout(self.config.start_timeout_s):
                h = await cluster.get_actor(name)  # waits while the runtime replaces it
                for _ in range(self.config.max_replacements):
                    try:
                        return str(await h.url())
                    except rlactors.ActorDiedError:  # the call reaches its next incarnation: again
                        continue
                return str(await h.url())
        except TimeoutError:
            limit = self.config.start_timeout_s
            raise EnvError(f"OpenEnv server {name} did not answer in {limit}s") from None
        except (rlactors.ActorNotFoundError, rlactors.ActorDiedError):
            raise EnvError(f"OpenEnv server {name} is gone (its replacements are spent)") from None
        except rlactors.RemoteError as e:
            raise EnvError(f"OpenEnv server {name}: {e}") from None
