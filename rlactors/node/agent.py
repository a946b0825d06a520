"""The node agent: one per host. Spawns a worker process per actor and watches it.

It sets each worker's environment (CUDA_VISIBLE_DEVICES from the GPUs placement gave it,
plus whatever the spawn asked for), forwards the worker's stdout/stderr line by line
with an actor prefix, notices a worker's exit the moment it happens (the process is our
child; no heartbeat needed) and tells the head, heartbeats to the head, and reserves free
ports on its host for rendezvous.

What a worker may run: with ``allowed_modules`` the agent starts only actor classes whose module
is under one of those dotted prefixes, and refuses any other spawn with a PermissionError naming
the class and the list. What a worker may do: it is handed the call credential on its stdin,
never the cluster secret, unless its actor was spawned with ``control=True`` (see
:mod:`rlactors.wire.security`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import structlog

from rlactors.base.aio import wait_for
from rlactors.base.awake import AwakeTimer, awake_clock
from rlactors.base.errors import ActorDiedError, ClusterError, exception_from_payload
from rlactors.base.forensics import collect_dump, read_tick
from rlactors.base.logging import Throttle
from rlactors.base.procs import STOP_SIGNAL, exit_reason
from rlactors.wire.client import Connection
from rlactors.wire.security import Security, control_plane, module_allowed
from rlactors.wire.service import ACTIVITY_TARGET
from rlactors.wire.transport import HEARTBEAT_TIMEOUT_MS

if TYPE_CHECKING:  # imported where used: `python -m rlactors.node.forkserver` runs it as __main__
    from rlactors.node.forkserver import ForkedProcess, ForkServer

log = structlog.get_logger("rlactors.node.agent")

Child: TypeAlias = "asyncio.subprocess.Process | ForkedProcess"  # a worker process: exec'd, or forked (rlactors.node.forkserver)
STATUS_TIMEOUT_S = 1.0  # a worker that does not say what it is doing within this is "not answering"

LogSink = Callable[[str], None]


def _stderr_sink(line: str) -> None:
    sys.stderr.write(line)
    sys.stderr.flush()


class _Liveness:
    """The agent's own connection to one of its workers: when the worker was last heard from.

    The transport pings it every second, and the worker's ping thread answers while its event loop
    is blocked, so a busy or blocked loop still answers; only a stopped or wedged process (SIGSTOP,
    swap, a hung kernel call) goes silent.
    """

    def __init__(self, spec: dict[str, Any], pid: int) -> None:
        self.spec, self.pid = spec, pid
        self.conn: Connection | None = None
        self.silent_since: float | None = None  # monotonic; None while the link is up
        self.fence: AwakeTimer | None = None

    def heard_s(self) -> float | None:
        """Seconds since the worker last answered (None: it never connected)."""
        if self.silent_since is None:
            return 0.0 if self.conn is not None and self.conn.linked else None
        return time.monotonic() - self.silent_since

    def close(self) -> None:
        if self.fence is not None:
            self.fence.cancel()
        if self.conn is not None:
            self.conn.close()


class NodeAgent:
    """Spawns and supervises worker processes on one host. Served with target ``"agent"``."""

    def __init__(
        self,
        node_id: str,
        head_address: str,
        *,
        host: str,
        resources: dict[str, float],
        session_dir: Path,
        transport: str = "ipc",
        security: Security | None = None,
        allowed_modules: Sequence[str] | None = None,
        log_sink: LogSink = _stderr_sink,
        log_dir: Path | None = None,
        python: str = sys.executable,
        startup_timeout: float = 600.0,
    ) -> None:
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', not {transport!r}")
        self.node_id = node_id
        self.head_address = head_address
        self.host = host
        self.resources = resources
        self.session_dir = session_dir
        self.transport = transport
        self.security = security
        # dotted prefixes of the actor-class modules this node starts (None or empty: every module)
        self.allowed_modules = [m for m in allowed_modules or [] if m] or None
        self.log_sink = log_sink
        self.log_dir = log_dir
        self.python = python
        self.startup_timeout = startup_timeout
        self.address = ""
        self._procs: dict[str, Child] = {}
        # workers of our own packages fork from a process that has imported their module (see
        # rlactors.node.forkserver); started with the first such worker, None until then
        self.fork_workers = True  # false once a fork server could not be started
        self._fork: ForkServer | None = None
        self._fork_lock = asyncio.Lock()
        self._starting: dict[str, tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._head: Connection | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._ports_given: dict[int, float] = {}
        self._live: dict[str, _Liveness] = {}
        self._fenced: dict[int, str] = {}  # pid -> why the agent killed it
        self.fence_after: float | None = None  # from the head at registration; None: never fence
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self._visible_gpus = [d.strip() for d in visible.split(",") if d.strip()] if visible else []
        self.stopped = asyncio.Event()
        # Told to stop (a scheduler's SIGTERM) while its head may still have runs: stop when the head
        # no longer answers, or says so (`rlactors down`).
        self.leaving = False

    def _spawn_task(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _physical_gpu(self, index: int) -> str:
        if self._visible_gpus and index < len(self._visible_gpus):
            return self._visible_gpus[index]
        return str(index)

    async def start(self, address: str) -> None:
        """Register with the head (at ``address`` this agent is served) and start heartbeats."""
        self.address = address
        if self._head is not None:  # a retry: drop the socket whose register_node is still queued
            self._head.close()
        self._head = Connection(self.head_address, self.security, name="head")
        interval = await self._register()
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat(interval), name="agent-heartbeat")

    async def _register(self) -> float:
        assert self._head is not None
        reply = await wait_for(
            self._head.call(
                "register_node", (self.node_id, self.address, self.host, self.resources), {}, target="head"
            ),
            30,
        )
        self.fence_after = reply.get("fence_after")
        return float(reply["heartbeat_interval"])

    async def _beat(self, interval: float) -> None:
        assert self._head is not None
        beat_failed = Throttle(log, "heartbeat to head failed", 10.0)  # a few lines per head outage
        while True:
            await asyncio.sleep(interval)
            try:
                known = await wait_for(
                    self._head.call("heartbeat", (self.node_id,), {}, target="head"), interval * 3
                )
                if not known:
                    log.warning("head forgot this node; registering again", node=self.node_id)
                    await self._kill_all()
                    await self._register()
            except (TimeoutError, ClusterError, OSError) as e:
                if self.leaving:
                    log.warning("the head is gone; this agent stops as it was told", node=self.node_id)
                    self._spawn_task(self.stop(grace=2.0), "agent-stop")
                    return
                beat_failed(node=self.node_id, error=repr(e))

    # --- workers --------------------------------------------------------------------------------

    @control_plane
    async def start_worker(self, actor_id: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Start a worker for ``actor_id`` and wait until its actor is constructed."""
        cls = spec["class"]
        if not module_allowed(cls["module"], self.allowed_modules):
            raise PermissionError(
                f"node {self.node_id} refuses to start actor class {cls['module']}:{cls['qualname']}: its module "
                f"is outside this node's allowed_modules {self.allowed_modules}; add its package to "
                "allowed_modules ([cluster] in cluster.toml, or rlactors.init(allowed_modules=...))"
            )
        loop = asyncio.get_running_loop()
        bind = (
            f"ipc://{self.session_dir}/w-{actor_id}-{spec.get('restarts', 0)}"
            if self.transport == "ipc"
            else f"tcp://{self.host}:0"
        )
        spec = dict(spec, bind=bind, head_address=self.head_address)
        ready: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._starting[actor_id] = (spec, ready)
        env = dict(os.environ)
        env.update(
            RLACTORS_AGENT=self.address,
            RLACTORS_ACTOR_ID=actor_id,
            RLACTORS_NODE_ID=self.node_id,
            RLACTORS_PARENT_PID=str(os.getpid()),
            RLACTORS_FORENSICS=str(self._forensics_files(actor_id, int(spec.get("restarts", 0)))),
            PYTHONUNBUFFERED="1",
        )
        # The worker's credential comes on its stdin (below), never as a file or in the environment
        # its own children inherit; a secret file named in this agent's environment is not passed on.
        env.pop("RLACTORS_SECRET_FILE", None)
        credential = b""
        if self.security is not None:
            env["RLACTORS_WORKER_SECURITY"] = self.security.mechanism
            credential = self.security.credential(control=bool(spec.get("control"))).encode() + b"\n"
        if spec.get("gpus") or self.resources.get("gpu"):
            # Placement hands out indices 0..n-1 of the GPUs this agent sees; map them through the
            # agent's own CUDA_VISIBLE_DEVICES (a Slurm job or a shared host may restrict it).
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self._physical_gpu(g) for g in spec.get("gpus", []))
        env.update({str(k): str(v) for k, v in (spec.get("env") or {}).items()})
        label = spec.get("name") or f"{spec['class']['qualname']}:{actor_id[:6]}"
        try:
            forked = await self._fork_worker(cls["module"], label, env, spec.get("cwd"), bool(credential))
            proc: Child = (
                forked
                if forked is not None
                else await asyncio.create_subprocess_exec(
                    self.python,
                    "-m",
                    "rlactors.node.worker",
                    label,  # ignored by the worker; makes `ps` say which actor a process runs
                    env=env,
                    cwd=spec.get("cwd") or None,
                    stdin=asyncio.subprocess.PIPE if credential else asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )
            )
        except OSError as e:
            self._starting.pop(actor_id, None)
            raise ClusterError(f"node {self.node_id}: cannot start a worker with {self.python}: {e}") from e
        self._procs[actor_id] = proc
        if proc.stdin is not None:  # a few bytes into an empty pipe: written at once
            proc.stdin.write(credential)
            proc.stdin.close()
        prefix = f"({label} pid={proc.pid}) "
        logfile = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            logfile = open(self.log_dir / f"{label.replace('/', '_')}-{actor_id}.log", "a", buffering=1)  # noqa: ASYNC230 (a local log file; opening it is quick)
        pumps = [
            loop.create_task(self._pump(proc.stdout, prefix, logfile)),
            loop.create_task(self._pump(proc.stderr, prefix, logfile)),
        ]
        self._spawn_task(self._watch(actor_id, proc, ready, pumps, logfile), name=f"watch-{actor_id}")
        try:
            started = await wait_for(asyncio.shield(ready), self.startup_timeout)
            self._watch_liveness(actor_id, spec, proc, started["address"])
            return started
        except TimeoutError:
            proc.kill()
            raise ClusterError(
                f"actor {label} did not finish starting within {self.startup_timeout:.0f}s"
            ) from None
        finally:
            self._starting.pop(actor_id, None)

    async def _fork_worker(
        self, module: str, label: str, env: dict[str, str], cwd: str | None, credential: bool
    ) -> ForkedProcess | None:
        """A worker forked from this node's fork server (started here at the first worker of a
        class of ours); None when it should be exec'd: a class of the user's, a fork server that
        would not fork it (see rlactors.node.forkserver), or none to be had."""
        from rlactors.node.forkserver import PIPE, ForkServer, preloadable

        if not self.fork_workers or not preloadable(module):
            return None
        async with self._fork_lock:
            if self._fork is None:
                path = self.session_dir / f"fork-{self.node_id[:12]}.sock"
                try:
                    self._fork = await ForkServer.start(path, self.python)
                except OSError as e:
                    log.warning("no fork server; workers are exec'd", node=self.node_id, error=repr(e))
                    self.fork_workers = False
                    return None
        fork = self._fork
        # the server is the worker's parent: the worker watches it, and dies with it (and it with
        # us); a worker that starts processes of its own (a launcher's inference server) forks them there
        env = dict(
            env,
            RLACTORS_PARENT_PID=str(fork.pid),
            RLACTORS_FORKSERVER=fork.path,
            RLACTORS_FORKSERVER_PID=str(fork.pid),
        )
        if not fork.can_fork(env):
            return None
        return await fork.spawn(
            "rlactors.node.worker",
            [label],
            env=env,
            cwd=cwd or None,
            preload=[module],
            stdin=PIPE if credential else None,
            stdout=PIPE,
            stderr=PIPE,
            python=self.python,
        )

    async def _pump(self, stream: asyncio.StreamReader | None, prefix: str, logfile: Any) -> None:
        if stream is None:
            return
        # Read in chunks, not readline(): one line over the reader's limit would end the pump,
        # and a worker whose pipe nobody drains blocks on its next print.
        partial = b""
        while chunk := await stream.read(65536):
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            if len(partial) > 65536:  # a very long line: pass it on in pieces
                lines.append(partial)
                partial = b""
            for line in lines:
                self._emit(prefix, line.decode(errors="replace") + "\n", logfile)
        if partial:
            self._emit(prefix, partial.decode(errors="replace") + "\n", logfile)

    def _emit(self, prefix: str, text: str, logfile: Any) -> None:
        if logfile is not None:
            logfile.write(text)
        try:
            self.log_sink(prefix + text)
        except Exception:  # a broken sink must not stop the draining
            pass

    async def _watch(
        self,
        actor_id: str,
        proc: Child,
        ready: asyncio.Future[dict[str, Any]],
        pumps: list[asyncio.Task[None]],
        logfile: Any,
    ) -> None:
        rc = await proc.wait()
        reason = exit_reason(rc)
        if proc.pid in self._fenced:
            reason = f"{self._fenced.pop(proc.pid)} ({reason})"
        live = self._live.get(actor_id)
        if live is not None and live.pid == proc.pid:
            del self._live[actor_id]
            live.close()
        if self._procs.get(actor_id) is proc:
            del self._procs[actor_id]
        if not ready.done():
            # Let the traceback reach the log before reporting the failure.
            with contextlib.suppress(TimeoutError):
                await wait_for(asyncio.gather(*pumps), 2)
            ready.set_exception(ActorDiedError(f"actor {actor_id} failed to start: {reason}", actor_id))
        elif self._head is not None and not self.stopped.is_set():
            try:
                await wait_for(self._head.call("actor_exited", (actor_id, reason), {}, target="head"), 30)
            except Exception as e:  # head gone, connection lost: its heartbeats tell it too
                log.warning("could not report a worker's exit to the head", actor=actor_id, error=repr(e))
        with contextlib.suppress(TimeoutError):
            await wait_for(asyncio.gather(*pumps), 2)
        if logfile is not None:
            logfile.close()

    def _watch_liveness(self, actor_id: str, spec: dict[str, Any], proc: Child, address: str) -> None:
        if proc.returncode is not None:
            return
        live = _Liveness(spec, proc.pid)
        live.conn = Connection(
            address,
            self.security.calls if self.security is not None else None,
            name=f"liveness of {actor_id}",
            on_link=lambda up: self._on_worker_link(actor_id, proc, live, up),
        )
        old = self._live.pop(actor_id, None)
        if old is not None:
            old.close()
        self._live[actor_id] = live

    def _on_worker_link(self, actor_id: str, proc: Child, live: _Liveness, up: bool) -> None:
        if up:
            live.silent_since = None
            if live.fence is not None:
                live.fence.cancel()
                live.fence = None
            return
        if live.silent_since is not None or proc.returncode is not None:
            return
        # The transport cuts the link once the worker was silent for HEARTBEAT_TIMEOUT: silent since then.
        silent_for = HEARTBEAT_TIMEOUT_MS / 1000
        live.silent_since = time.monotonic() - silent_for
        if self.fence_after is not None:
            delay = max(0.0, self.fence_after - silent_for)
            # Counted in awake time: a stalled agent heard nothing because it was not listening.
            # A fresh context: the log lines of the fence are not the call's that started the worker.
            live.fence = awake_clock().call_later(
                delay, self._fence, actor_id, proc, live, context=contextvars.Context()
            )

    def _fence(self, actor_id: str, proc: Child, live: _Liveness) -> None:
        """A worker silent past ``fence_after``: kill it (SIGKILL ends a stopped process too) so
        that the head restarts it, if it has restarts left; else leave it (it may wake up)."""
        live.fence = None
        if proc.returncode is not None or self._procs.get(actor_id) is not proc:
            return
        restarts, most = int(live.spec.get("restarts", 0)), int(live.spec.get("max_restarts", 0))
        silent = round(time.monotonic() - (live.silent_since or time.monotonic()), 1)
        if restarts >= most:
            log.warning(
                "worker stopped answering; no restarts left, so it is left running",
                actor=actor_id,
                pid=proc.pid,
                silent_s=silent,
            )
            return
        log.warning(
            "worker stopped answering; killing it so it can be restarted",
            actor=actor_id,
            pid=proc.pid,
            silent_s=silent,
            fence_after=self.fence_after,
        )
        self._fenced[proc.pid] = (
            f"worker process stopped answering for {silent:g}s (more than fence_after={self.fence_after:g}s) "
            "and was killed by its node agent"
        )
        with contextlib.suppress(ProcessLookupError):
            proc.kill()

    async def worker_status(self) -> list[dict[str, Any]]:
        """Each worker of this node: pid, seconds since it was last heard from, and what it is doing
        (None when it does not answer within a second)."""

        async def one(actor_id: str, live: _Liveness) -> dict[str, Any]:
            entry: dict[str, Any] = {
                "actor_id": actor_id,
                "pid": live.pid,
                "heard_s": live.heard_s(),
                "activity": None,
            }
            if live.conn is not None and live.conn.linked:
                with contextlib.suppress(TimeoutError, ClusterError):
                    call = live.conn.call("activity", (), {}, target=ACTIVITY_TARGET)
                    entry["activity"] = await wait_for(call, STATUS_TIMEOUT_S)
                    entry["heard_s"] = 0.0
            return entry

        return list(await asyncio.gather(*(one(a, live) for a, live in list(self._live.items()))))

    def _forensics_files(self, actor_id: str, restarts: int) -> Path:
        """Where a worker's stacks dump (``.stacks``) and loop tick (``.tick``) go: the session dir."""
        return self.session_dir / f"forensics-{actor_id}-{restarts}"

    async def worker_stacks(
        self, actor_ids: list[str] | None, timeout_s: float = 3.0
    ) -> list[dict[str, Any]]:
        """What each of these workers (None: all) is doing, from its own loop (see
        ``Service.stacks``); a worker whose loop does not answer within a third of ``timeout_s`` is
        unresponsive: for how long its loop has not ticked, and its stacks dumped by signal."""

        async def one(actor_id: str, live: _Liveness) -> dict[str, Any]:
            entry: dict[str, Any] = {"actor_id": actor_id, "pid": live.pid, "responsive": False}
            if live.conn is not None and live.conn.linked:
                with contextlib.suppress(TimeoutError, ClusterError):
                    call = live.conn.call("stacks", (), {}, target=ACTIVITY_TARGET)
                    entry.update(await wait_for(call, timeout_s / 3), responsive=True)
                    return entry
            files = self._forensics_files(actor_id, int(live.spec.get("restarts", 0)))
            tick, loop_thread = read_tick(files.with_suffix(".tick"))
            entry["unresponsive_s"] = None if tick is None else round(time.monotonic() - tick, 3)
            entry["loop_thread"] = loop_thread
            entry["dump"] = await collect_dump(live.pid, files.with_suffix(".stacks"), timeout_s / 3)
            return entry

        wanted = [(a, live) for a, live in list(self._live.items()) if actor_ids is None or a in actor_ids]
        return list(await asyncio.gather(*(one(a, live) for a, live in wanted)))

    async def worker_hello(self, actor_id: str) -> dict[str, Any]:
        """A new worker asks what to run."""
        entry = self._starting.get(actor_id)
        if entry is None:
            raise ClusterError(f"node {self.node_id} is not starting actor {actor_id}")
        return entry[0]

    async def worker_ready(self, actor_id: str, address: str, methods: dict[str, str], pid: int) -> None:
        entry = self._starting.get(actor_id)
        if entry is not None and not entry[1].done():
            entry[1].set_result({"address": address, "methods": methods, "pid": pid})

    async def worker_failed(self, actor_id: str, payload: dict[str, Any]) -> None:
        entry = self._starting.get(actor_id)
        if entry is not None and not entry[1].done():
            entry[1].set_exception(exception_from_payload(payload))

    @control_plane
    async def kill_worker(self, actor_id: str, grace: float = 0.0) -> bool:
        """Kill a worker (SIGKILL); with ``grace``, ask it to stop first (its ``on_stop`` runs) and
        kill it only if it is still there ``grace`` seconds later."""
        proc = self._procs.get(actor_id)
        if proc is None or proc.returncode is not None:
            return False
        if grace <= 0:
            proc.kill()
            return True
        proc.send_signal(STOP_SIGNAL)
        asyncio.get_running_loop().call_later(grace, self._kill_if_running, proc)
        return True

    @staticmethod
    def _kill_if_running(proc: Child) -> None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    async def reserve_port(self) -> int:
        """A free TCP port on this host, not handed out in the last minute."""
        now = time.monotonic()
        self._ports_given = {p: t for p, t in self._ports_given.items() if now - t < 60}
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((self.host if self.transport == "tcp" else "127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in self._ports_given:
                self._ports_given[port] = now
                return port
        raise ClusterError(f"node {self.node_id}: no free port found")

    async def _kill_all(self, grace: float = 0.0) -> None:
        procs = [p for p in self._procs.values() if p.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(STOP_SIGNAL) if grace > 0 else p.kill()
        if procs:
            _, pending = await asyncio.wait(
                [asyncio.ensure_future(p.wait()) for p in procs], timeout=grace or 5
            )
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            if pending:
                await asyncio.wait(pending, timeout=5)

    @control_plane
    async def shutdown(self) -> None:
        """Stop every worker and this agent (remote `rlactors down`)."""
        asyncio.get_running_loop().call_soon(lambda: self._spawn_task(self.stop(grace=2.0), "agent-stop"))

    async def stop(self, grace: float = 0.0) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for live in self._live.values():
            live.close()
        self._live.clear()
        await self._kill_all(grace)
        if self._fork is not None:
            await self._fork.close()
        for t in list(self._tasks):
            if t is not asyncio.current_task():
                t.cancel()
        if self._head is not None:
            self._head.close()
