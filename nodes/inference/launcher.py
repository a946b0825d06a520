"""Launch and supervise an inference server process: the reference server or real SGLang.

:class:`ServerSupervisor` is a plain asyncio class (usable without the actor runtime): it starts
the server on a free loopback port (or the given host/port) with the environment placement gave
it (e.g. ``CUDA_VISIBLE_DEVICES``), waits for ``/health_generate``, restarts it if it dies, and
stops it (whole process group) cleanly. A scheduler's SIGTERM to the job is left to the
server's owner (:func:`child_setup`). :class:`InferenceServerActor` is the thin actor around it.

Keys (SGLang's ``--api-key`` and ``--admin-api-key``, :class:`~protocols.http.auth.ServerKeys`): a server
that listens beyond loopback is always started with keys (``auth = "auto"``, the default), one on
loopback only when its config says ``auth = "on"``. One pair per cluster: :func:`cluster_keys`
makes it once and keeps it in the cluster's key-value store, where every
:class:`InferenceServerActor` takes it from (a server launched later, by the inference pool or by
hand, too); the driver hands the same pair to every client of the servers (the rollout client,
the weight push, policy sync, evaluation, the stall watchdog). Outside a cluster a supervisor
takes the keys it is given, else a fresh pair; :attr:`ServerSupervisor.keys` and
:meth:`InferenceServerActor.server_keys` say which. The keys reach the server without showing on
its command line: through the environment (ours) or a private ``--config`` file (SGLang).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx  # health polls while a server starts and stops: rare calls, not /generate's wire
import structlog

from nodes.common.flags import to_argv
from nodes.common.procs import HOLD_SIGTERM, child_setup, free_port, stop_process_group
from nodes.inference.settings import ServerSettings
from protocols.http.auth import ServerKeys
from protocols.runtime.codec import register

if TYPE_CHECKING:
    from rlactors.node.forkserver import ForkedProcess

log = structlog.get_logger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]  # the folder holding `nodes` (site-packages when installed)

# "auto": keys when the server listens beyond loopback; "on": always; "off": never
Auth = Literal["auto", "on", "off"]
KEYS_KV = "secret/inference/server-keys"  # the cluster's pair: a secret key (control credential only)


async def cluster_keys(cluster: Any) -> ServerKeys:
    """The cluster's server keys (``--api-key``, ``--admin-api-key``): made and stored on first
    use, the same pair afterwards. The head keeps them in memory; only cluster members (who hold
    the cluster secret) can ask for them."""
    try:
        stored = await cluster.kv_get(KEYS_KV)
    except KeyError:  # none yet (the head answers an absent key so)
        stored = None
    if not stored:  # the driver makes them before it starts servers, so two never race here
        fresh = ServerKeys.new()
        await cluster.kv_put(KEYS_KV, [fresh.api_key, fresh.admin_api_key])
        stored = await cluster.kv_get(KEYS_KV)
    return ServerKeys(*stored)


@register
@dataclass
class ReferenceServerConfig(ServerSettings):
    """The reference server a launcher starts: its settings (:class:`ServerSettings`, the keys of
    ``python -m nodes.inference.server``, one definition) and how the launcher starts it; the
    launcher picks the address and port."""

    auth: Auth = "auto"  # --api-key/--admin-api-key: beyond loopback always; on loopback if "on"
    extra_args: list[str] = field(default_factory=list)  # more flags for `python -m nodes.inference.server`

    def command(self, host: str, port: int) -> list[str]:
        """The command line that starts this server: the settings that differ from their defaults
        as flags (:func:`~nodes.common.flags.to_argv`), then ``extra_args``."""
        where = ["--host", host, "--port", str(port)]
        settings = to_argv(self, ServerSettings)
        return [sys.executable, "-m", "nodes.inference.server", *where, *settings, *self.extra_args]


# the two sgl-kernel ops SGLang's CPU engine needs (a folder for PYTHONPATH; package data)
SGLANG_CPU_SHIM = Path(__file__).resolve().parent / "sglang_cpu"
# a sitecustomize that keeps SIGTERM ignored in every Python process of SGLang's (see child_setup)
HOLD_SIGTERM_BOOT = Path(__file__).resolve().parent / "hold_sigterm"


@register
@dataclass
class SGLangServerConfig:
    """Arguments for ``python -m sglang.launch_server`` (real, unmodified SGLang).

    On GPUs SGLang is usually installed beside rlactors (``python`` empty: this interpreter). On
    CPU (``device="cpu"``) it runs from its own venv (``scripts/sglang-setup.sh`` installs one
    and prints its python) with SGLang's CPU engine, our pure-torch stand-in for the two
    sgl-kernel ops it needs, and the flags found to work on CPU (``env()`` and ``command()``).
    """

    model_path: str  # --model-path (the recipe sets it from [model])
    python: str = ""  # the interpreter that has sglang ("" = this one)
    device: str = "cuda"  # cuda | cpu
    tp_size: int = 1  # --tp-size: GPUs one server shards the model over
    # --mem-fraction-static: the share of memory for weights and KV (None: SGLang's own; 0.2 on CPU)
    mem_fraction_static: float | None = None
    dtype: str = "auto"  # --dtype (auto on CPU: float32)
    random_seed: int | None = None  # --random-seed (None: SGLang's own)
    context_length: int | None = None  # --context-length (None: the model's)
    max_running_requests: int | None = None  # --max-running-requests (None: SGLang's own)
    auth: Auth = "auto"  # --api-key/--admin-api-key: beyond loopback always; on loopback if "on"
    extra_args: list[str] = field(default_factory=list)  # more flags for sglang.launch_server

    def command(self, host: str, port: int) -> list[str]:
        """The command line that starts SGLang."""
        cpu = self.device == "cpu"
        cmd = [
            self.python or sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            host,
            "--port",
            str(port),
            "--tp-size",
            str(self.tp_size),
            "--dtype",
            "float32" if cpu and self.dtype == "auto" else self.dtype,
        ]
        mem = self.mem_fraction_static if self.mem_fraction_static is not None else (0.2 if cpu else None)
        if mem is not None:
            cmd += ["--mem-fraction-static", str(mem)]
        if self.random_seed is not None:
            cmd += ["--random-seed", str(self.random_seed)]
        if self.context_length is not None:
            cmd += ["--context-length", str(self.context_length)]
        if self.max_running_requests is not None:
            cmd += ["--max-running-requests", str(self.max_running_requests)]
        if cpu:  # without --sleep-on-idle the idle scheduler busy-polls a core
            cmd += ["--device", "cpu", "--disable-overlap-schedule", "--sleep-on-idle"]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """Environment the server needs on top of the worker's."""
        if self.device != "cpu":
            return {}
        return {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(SGLANG_CPU_SHIM)}


ServerConfig = ReferenceServerConfig | SGLangServerConfig


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``); a name is taken as routable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def wants_keys(auth: str, host: str) -> bool:
    """Whether a server with ``auth`` listening on ``host`` is started with keys."""
    if auth not in ("auto", "on", "off"):
        raise ValueError(f"auth = {auth!r}: expected auto, on or off")
    return auth == "on" or (auth == "auto" and not is_loopback(host))


class ServerStartError(RuntimeError):
    """The server process exited or did not become healthy in time."""


class ServerSupervisor:
    """Owns one server process: start, health, restart-on-crash, stop."""

    def __init__(
        self,
        config: ServerConfig,
        host: str = "127.0.0.1",
        port: int | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        max_restarts: int = 3,
        log_path: str | Path | None = None,
        keys: ServerKeys | None = None,
    ) -> None:
        """``keys``: the keys to start the server with when it takes keys (see the module's
        docstring); None: a fresh pair then."""
        self.config = config
        self.host = host
        self.port = port or free_port(host)
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.restarts = 0
        self.log_path = Path(log_path) if log_path else None
        self.proc: asyncio.subprocess.Process | ForkedProcess | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._stopping = False
        if wants_keys(config.auth, host):
            self.keys = keys if keys else ServerKeys.new()
        else:
            self.keys = ServerKeys()
            if config.auth == "off" and not is_loopback(host):
                log.warning("server_without_keys", host=host, why="auth = off beyond loopback")
        self._secrets: Path | None = None  # a private folder for SGLang's --config file

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        """Launch the process and wait until ``/health_generate`` answers 200; returns the URL."""
        self._stopping = False
        await self._spawn()
        self._monitor = asyncio.create_task(self._watch(), name=f"supervise:{self.port}")
        return self.url

    async def _spawn(self) -> None:
        cmd = self.config.command(self.host, self.port)
        if self.keys and isinstance(self.config, SGLangServerConfig):
            cmd += ["--config", str(self._key_file())]
        env = self.spawn_env()
        out = self._open_log()
        try:
            self.proc = await self._fork(cmd, env, out)
            if self.proc is None:
                self.proc = await asyncio.create_subprocess_exec(
                    *HOLD_SIGTERM,
                    *cmd,
                    env=env,
                    cwd=str(REPO_ROOT),
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    preexec_fn=functools.partial(child_setup, os.getpid()),
                )
        finally:
            if self.log_path:
                out.close()
        log.info("server_spawned", pid=self.proc.pid, url=self.url, cmd=" ".join(cmd))
        await self._wait_healthy()

    async def _fork(self, cmd: list[str], env: dict[str, str], out: Any) -> ForkedProcess | None:
        """Our server, forked from the node's fork server with torch and transformers imported
        (see rlactors.node.forkserver), in the state :func:`child_setup` and :data:`HOLD_SIGTERM` give
        an exec'd one: its own session, SIGTERM blocked, killed when this worker ends. None: exec it
        (SGLang; outside a node agent's forked worker; an environment the server would not fork)."""
        if isinstance(self.config, SGLangServerConfig) or cmd[:2] != [sys.executable, "-m"]:
            return None
        from rlactors.node.forkserver import node_fork_server

        fork = await node_fork_server()
        if fork is None or not fork.can_fork(env):
            return None
        return await fork.spawn(
            cmd[2],
            cmd[3:],
            env=env,
            cwd=str(REPO_ROOT),
            preload=[cmd[2]],
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            session=True,
            block=[signal.SIGTERM],
        )

    def spawn_env(self) -> dict[str, str]:
        """The server's environment: the worker's with ``env`` on top, our server's keys, and what
        SGLang needs (:meth:`SGLangServerConfig.env`, and :data:`HOLD_SIGTERM_BOOT` first on its path)."""
        env = {**os.environ, **self.env}
        if isinstance(self.config, SGLangServerConfig):
            extra = self.config.env()
            env.update({k: v for k, v in extra.items() if k != "PYTHONPATH"})
            env["RLACTORS_HOLD_SIGTERM"] = "1"  # HOLD_SIGTERM_BOOT acts only with it
            paths: tuple[str, ...] = (
                str(HOLD_SIGTERM_BOOT),
                extra.get("PYTHONPATH", ""),
                env.get("PYTHONPATH", ""),
            )
        else:
            env["RLACTORS_SERVER_API_KEY"] = self.keys.api_key  # also when empty: none inherited
            env["RLACTORS_SERVER_ADMIN_API_KEY"] = self.keys.admin_api_key
            paths = (str(REPO_ROOT), env.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        return env

    def _key_file(self) -> Path:
        """SGLang's ``--config`` YAML holding the keys, readable by this user only (removed at stop)."""
        if self._secrets is None:
            self._secrets = Path(tempfile.mkdtemp(prefix="rlactors-server-"))  # mode 700
        path = self._secrets / "keys.yaml"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        # JSON is YAML (the keys stay strings); SGLang turns each entry into the flag spelled so: hyphens
        with os.fdopen(fd, "w") as f:
            json.dump({"api-key": self.keys.api_key, "admin-api-key": self.keys.admin_api_key}, f)
        return path

    def _open_log(self) -> Any:
        """The server's stdout/stderr target: the log file (append) or /dev/null."""
        if self.log_path is None:
            return asyncio.subprocess.DEVNULL
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # this user's only: SGLang writes its arguments, keys included, into it at start-up
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return os.fdopen(fd, "ab")  # a local file open, not a network wait

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=30.0) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.returncode is not None:
                    raise ServerStartError(
                        f"server exited with code {self.proc.returncode} during start-up"
                        + (f"; see {self.log_path}" if self.log_path else "")
                    )
                with contextlib.suppress(httpx.HTTPError):
                    r = await client.get(self.url + "/health_generate")
                    if r.status_code == 200:
                        return
                await asyncio.sleep(0.2)  # poll interval while the server loads
        await self._kill()
        raise ServerStartError(f"server at {self.url} not healthy after {self.startup_timeout_s:.0f} s")

    async def _watch(self) -> None:
        """Restart the server when its process exits unexpectedly (up to ``max_restarts``)."""
        while not self._stopping:
            assert self.proc is not None
            code = await self.proc.wait()
            if self._stopping:
                return
            if self.restarts >= self.max_restarts:
                log.error("server_died_no_restarts_left", code=code, url=self.url)
                return
            self.restarts += 1
            log.warning("server_died_restarting", code=code, url=self.url, restart=self.restarts)
            try:
                await self._spawn()
            except ServerStartError as e:
                log.error("server_restart_failed", error=str(e))
                return

    async def health(self, timeout_s: float = 30.0) -> bool:
        """True if ``/health_generate`` answers 200 within ``timeout_s``."""
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                r = await client.get(self.url + "/health_generate")
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def restart(self) -> str:
        """Stop and start again on the same port."""
        await self.stop()
        return await self.start()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the server's process group; kill it if it does not exit in ``timeout_s``."""
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        await self._kill(timeout_s)
        if self._secrets is not None:
            shutil.rmtree(self._secrets, ignore_errors=True)
            self._secrets = None

    async def _kill(self, timeout_s: float = 10.0) -> None:
        """:func:`stop_process_group` of the server."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        await stop_process_group(proc, timeout_s)
        log.info("server_stopped", url=self.url, code=proc.returncode)


try:  # the runtime may not be importable in every environment (e.g. a bare inference install)
    import rlactors as _rlactors

    _ActorBase: type = getattr(_rlactors, "Actor", object)
except ImportError:
    _ActorBase = object


async def _node_host() -> str:
    """The address this actor's node registered with the head (127.0.0.1 outside a cluster)."""
    try:
        ctx = _rlactors.get_context()
    except Exception:  # not in an actor's worker (or no runtime)
        return "127.0.0.1"
    for node in await ctx.cluster.nodes():
        if node["node_id"] == ctx.node_id:
            return str(node["host"])
    return "127.0.0.1"


async def _cluster_keys() -> ServerKeys | None:
    """The cluster's pair, from the actor's worker (None outside a cluster)."""
    try:
        ctx = _rlactors.get_context()
    except _rlactors.ClusterError:  # not in an actor's worker
        return None
    return await cluster_keys(ctx.cluster)


class InferenceServerActor(_ActorBase):
    """An actor that runs one inference server on its node and exposes its URL.

    ``config`` is a :class:`ReferenceServerConfig` (our server) or an :class:`SGLangServerConfig`
    (real SGLang); it travels to the actor as it is.
    The actor's environment (``CUDA_VISIBLE_DEVICES`` from placement) is inherited by the server.
    ``host`` None binds the server to its node's address (the one the node registered with, which
    other hosts reach it by), so trainers and rollout actors on other hosts can connect; a local
    cluster's node is on 127.0.0.1. ``keys``: the pair to start the server with when it takes keys
    (``config.auth``), None: the cluster's (:func:`cluster_keys`); :meth:`server_keys` returns
    what the server took.
    """

    def __init__(
        self,
        config: ServerConfig,
        host: str | None = None,
        port: int | None = None,
        server_env: dict[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        server_max_restarts: int = 3,
        log_path: str | None = None,
        keys: ServerKeys | None = None,
    ) -> None:
        # (server_env / server_max_restarts: `env` and `max_restarts` are Cluster.spawn's own options.)
        self._config = config
        self._host, self._port = host, port
        self._options: dict[str, Any] = {  # ServerSupervisor's keyword arguments
            "env": server_env,
            "startup_timeout_s": startup_timeout_s,
            "max_restarts": server_max_restarts,
            "log_path": log_path,
            "keys": keys,
        }
        self._sup: ServerSupervisor | None = None
        self._started: asyncio.Task[str] | None = None
        self._lock = asyncio.Lock()  # one supervisor, however many calls arrive while it is made

    async def on_start(self) -> None:
        """Begin launching as soon as the actor is up (``url()`` waits for readiness)."""
        await self._ensure_started(wait=False)

    async def on_stop(self) -> None:
        """Take the server down with the actor."""
        if self._sup is not None:
            await self._sup.stop()

    async def _ensure_started(self, wait: bool = True) -> str:
        async with self._lock:
            if self._sup is None:
                host = self._host or await _node_host()
                options = dict(self._options)
                if options["keys"] is None and wants_keys(self._config.auth, host):
                    options["keys"] = await _cluster_keys()
                self._sup = ServerSupervisor(self._config, host=host, port=self._port, **options)
            if self._started is None:
                self._started = asyncio.create_task(self._sup.start())
        return await asyncio.shield(self._started) if wait else ""

    async def url(self) -> str:
        """The server's base URL (starts it on first call and waits until healthy)."""
        return await self._ensure_started()

    async def _supervisor(self) -> ServerSupervisor:
        """The server's supervisor, once it has started."""
        await self._ensure_started()
        assert self._sup is not None
        return self._sup

    async def server_keys(self) -> ServerKeys:
        """The keys the server was started with (empty: it takes none); see the module's docstring."""
        return (await self._supervisor()).keys

    async def health(self) -> bool:
        """Whether ``/health_generate`` answers 200."""
        return await (await self._supervisor()).health()

    async def restart(self) -> str:
        """Restart the server; returns its URL."""
        return await (await self._supervisor()).restart()

    async def stop(self) -> None:
        """Stop the server."""
        if self._sup is not None:
            await self._sup.stop()
        self._started = None
