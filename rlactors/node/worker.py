"""Entry point of a worker process: runs one actor on its own event loop (uvloop when available).

Started by a node agent as ``python -m rlactors.node.worker`` with its identity in the
environment and its credential (see :mod:`rlactors.wire.security`) on its stdin. It asks the agent for its spec, imports the actor class by module path (or
the driver's script by file, as multiprocessing's spawn does), binds its ROUTER socket,
constructs the actor and reports ready. It exits when its agent process goes away.

Stopping it is its agent's job: the agent asks with :data:`STOP_SIGNAL` (its ``on_stop`` hook runs)
and kills it past a grace period. SIGTERM and SIGINT are the driver's to handle while the agent
lives: a scheduler (Slurm, ``timeout``, systemd) or a terminal's Ctrl-C sends them to every process
of a job at once, and the driver's answer (finish the step, checkpoint, then stop its actors) needs
its workers alive. With its agent gone a worker stops anyway (the kernel kills it with its parent).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sys
from pathlib import Path
from typing import Any

import structlog

from protocols.runtime import codec
from rlactors.api.actor import ActorContext, _set_context
from rlactors.api.collective import SYSTEM_TARGET, WorkerSystem
from rlactors.base import logging as rlog
from rlactors.base.aio import wait_for
from rlactors.base.classpath import load_class
from rlactors.base.errors import exception_payload
from rlactors.base.forensics import LoopProbe, register_dump, unregister_dump
from rlactors.base.procs import STOP_SIGNAL, die_with_parent
from rlactors.wire.client import Connection
from rlactors.wire.runtime import RuntimeClient, set_current
from rlactors.wire.security import Security
from rlactors.wire.service import Service

log = structlog.get_logger("rlactors.node.worker")

_LEFT_TO_DRIVER = (signal.SIGTERM, signal.SIGINT)


def _ignore_until_loop(signum: int, frame: Any = None) -> None:
    """SIGTERM or SIGINT before the loop runs: the driver stops this worker (see the module docstring).

    A Python handler, not SIG_IGN: an ignored signal would stay ignored in the processes this worker
    starts (an inference server must still stop on SIGTERM)."""


def _on_job_signal(sig: signal.Signals, parent: int, stop: asyncio.Event) -> None:
    if os.getppid() != parent:  # no agent left to stop us
        stop.set()
        return
    log.info("signal left to the driver; this worker stops when its agent says so", signal=sig.name)


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    # No event exists for "parent changed"; a 1 s poll bounds how long an orphan lives.
    while os.getppid() == parent_pid:  # noqa: ASYNC110
        await asyncio.sleep(1.0)
    stop.set()


def _read_credential() -> Security | None:
    """The credential our agent wrote to our stdin (none when the cluster has no security); stdin
    is then /dev/null, so processes this worker starts inherit nothing of it."""
    mechanism = os.environ.pop("RLACTORS_WORKER_SECURITY", "")
    if not mechanism:
        return None
    line = sys.stdin.buffer.readline().strip().decode()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return Security.from_credential(line, mechanism)


async def main(security: Security | None) -> int:
    actor_id = os.environ["RLACTORS_ACTOR_ID"]
    parent = int(os.environ.get("RLACTORS_PARENT_PID", os.getppid()))
    die_with_parent(parent)  # no worker is orphaned
    agent = Connection(os.environ["RLACTORS_AGENT"], security, name="agent")
    spec: dict[str, Any] = await wait_for(agent.call("worker_hello", (actor_id,), {}, target="agent"), 60)
    name = spec.get("name")
    rlog.configure(actor=name or actor_id, node=spec.get("node_id"))
    for p in reversed(spec.get("sys_path") or []):
        if p not in sys.path:
            sys.path.insert(0, p)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(STOP_SIGNAL, stop.set)
    for sig in _LEFT_TO_DRIVER:
        loop.add_signal_handler(sig, _on_job_signal, sig, parent, stop)

    service = Service(
        name=name or actor_id, max_concurrency=int(spec.get("max_concurrency", 1000)), security=security
    )
    # A detached actor outlives the run that spawned it, and so do the actors it spawns (a pool's
    # servers launched by `rlactors pool launch`): they are its own, not that run's.
    run = "" if spec.get("detached") else spec.get("run")
    client = RuntimeClient(spec["head_address"], security, name=name or actor_id, run=run)
    # Forensics: the agent reads this worker's stacks by signal when its loop cannot answer, and
    # its loop's last tick (see rlactors.base.forensics).
    files = os.environ.get("RLACTORS_FORENSICS")
    dump = register_dump(Path(files + ".stacks")) if files else None
    probe = LoopProbe(Path(files + ".tick") if files else None)
    probe.start()
    service.probe, service.outgoing = probe, client.outgoing_calls
    try:
        cls = load_class(spec["class"])
        codec.trust_package(spec["class"]["module"])  # types the actor receives may live beside it
        address = service.bind(spec["bind"])
        await client.start()
        set_current(client)
        from rlactors.api.cluster import Cluster

        ctx = ActorContext(
            actor_id, name, spec.get("node_id", ""), Cluster(client), int(spec.get("restarts", 0))
        )
        _set_context(ctx)
        args, kwargs = codec.decode(spec["init"])
        instance = cls(*args, **kwargs)
        on_start = getattr(instance, "on_start", None)
        if on_start is not None:
            await on_start()
        methods = service.add(None, instance)
        bind_host = (
            spec["bind"].removeprefix("tcp://").rsplit(":", 1)[0]
            if spec["bind"].startswith("tcp://")
            else "127.0.0.1"
        )
        system = WorkerSystem(bind_host)
        service.add(SYSTEM_TARGET, system)
        service.collective = lambda: system.joined
        for hook in ("on_start", "on_stop"):
            methods.pop(hook, None)
        # What the start built (imports, a tokenizer, a model's Python objects) lives as long as the
        # actor: frozen, a full collection never walks it again, and the pauses of an actor that
        # holds thousands of sessions are those of their state alone (bench/RESULTS.md, "Load held")
        gc.collect()
        gc.freeze()
    except BaseException as e:  # whatever stopped the start, the agent hears of it before this process ends
        log.error("actor failed to start", error=repr(e))
        with contextlib.suppress(Exception):  # best effort: the agent also sees the process exit
            await wait_for(
                agent.call(
                    "worker_failed",
                    (actor_id, exception_payload(e, where=name or actor_id)),
                    {},
                    target="agent",
                ),
                10,
            )
        await service.close()
        return 1
    await agent.call("worker_ready", (actor_id, address, methods, os.getpid()), {}, target="agent")
    watcher = loop.create_task(_watch_parent(parent, stop))
    await stop.wait()
    watcher.cancel()
    on_stop = getattr(instance, "on_stop", None)
    if on_stop is not None:
        with contextlib.suppress(Exception):  # a user's hook: its failure must not stop the shutdown
            await wait_for(on_stop(), 10)
    await ctx._stop_watches()
    await service.close()
    await client.close()
    agent.close()
    probe.stop()
    if dump is not None:
        unregister_dump(dump)
    return 0


def run() -> None:
    for sig in _LEFT_TO_DRIVER:
        signal.signal(sig, _ignore_until_loop)
    security = _read_credential()  # before the loop starts: a blocking read of a few bytes
    try:
        import uvloop
    except ImportError:
        code = asyncio.run(main(security))
    else:
        code = uvloop.run(main(security))
    # Skip interpreter teardown of half-finished threads (e.g. a sync method still running).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
