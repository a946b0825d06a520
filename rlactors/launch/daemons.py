"""Standalone head and node-agent processes, as started by ``rlactors up``.

    python -m rlactors.launch.daemons head  --bind tcp://0.0.0.0:6380 --secret-file S
    python -m rlactors.launch.daemons agent --head tcp://H:6380 --node-id n1 --host 10.0.0.2 --secret-file S

Both serve until told to stop (``rlactors down``) or sent SIGTERM. A scheduler (Slurm at ``scancel`` or
the time limit) sends SIGTERM to every process of the job at once: the drivers of the runs on the
cluster answer it (finish the step, checkpoint, leave), so the daemons leave it to them. The head
stops once no run is connected; an agent once its head is gone. A second SIGTERM stops either at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import structlog

from rlactors.base import logging as rlog
from rlactors.head.head import Head
from rlactors.launch.local import detect_gpus, new_session_dir
from rlactors.node.agent import NodeAgent
from rlactors.wire.security import Security, load_secret
from rlactors.wire.service import Service
from rlactors.wire.transport import set_max_message_bytes, set_send_backlog

log = structlog.get_logger("rlactors.launch.daemons")


async def run_head(args: argparse.Namespace) -> int:
    rlog.configure(role="head")
    security = Security(load_secret(args.secret_file), args.security)
    service = Service(name="head", max_concurrency=None, security=security)
    head = Head(
        security,
        node_timeout=args.node_timeout,
        client_timeout=args.client_timeout or None,
        fence_after=args.fence_after or None,
        retain_finished=args.retain_finished,
    )
    address = service.bind(args.bind)
    service.add("head", head)
    head.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    waiting: list[asyncio.Task[None]] = []

    def on_signal(sig: signal.Signals) -> None:
        if waiting or not head.drivers():
            stop.set()
            return
        log.warning(
            "signal: the head stops once the runs connected have ended (again to stop now)",
            signal=sig.name,
            runs=[head.who(d) for d in head.drivers()],
        )
        waiting.append(loop.create_task(head.runs_ended()))
        waiting[0].add_done_callback(lambda _: stop.set())

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    head.on_exit = stop.set
    log.info("head serving", address=address)
    print(f"head ready at {address}", flush=True)
    await stop.wait()
    await head.stop()
    await service.close()
    security.stop()
    return 0


async def run_agent(args: argparse.Namespace) -> int:
    rlog.configure(role="agent", node=args.node_id)
    security = Security(load_secret(args.secret_file), args.security)
    resources = {"cpu": float(os.cpu_count() or 1), "gpu": float(detect_gpus())}
    resources.update({k: float(v) for k, v in json.loads(args.resources or "{}").items()})
    session_dir = new_session_dir(f"rlx-{args.node_id}-")
    try:
        return await _serve_agent(args, security, resources, session_dir)
    finally:
        shutil.rmtree(session_dir, ignore_errors=True)


async def _serve_agent(
    args: argparse.Namespace, security: Security, resources: dict[str, float], session_dir: Path
) -> int:
    service = Service(name=f"agent-{args.node_id}", security=security)
    agent = NodeAgent(
        args.node_id,
        args.head,
        host=args.host,
        resources=resources,
        session_dir=session_dir,
        transport="tcp",
        security=security,
        allowed_modules=args.allow_module,
        log_dir=args.log_dir,
    )
    address = service.bind(f"tcp://{args.host}:0")
    service.add("agent", agent)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def on_signal(sig: signal.Signals) -> None:
        if agent.leaving:  # the second signal: now
            stopping.append(loop.create_task(agent.stop(grace=2.0)))
            return
        log.warning("signal: this agent stops once its head is gone (again to stop now)", signal=sig.name)
        agent.leaving = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    deadline = loop.time() + args.connect_timeout
    while True:
        try:
            await agent.start(address)
            break
        except (TimeoutError, OSError) as e:
            if loop.time() > deadline:
                log.error("could not register with the head", head=args.head, error=repr(e))
                print(
                    f"agent {args.node_id}: no head answered at {args.head} (wrong address or secret?)",
                    file=sys.stderr,
                )
                await service.close()
                return 2
    log.info("agent serving", node=args.node_id, address=address, resources=resources)
    print(f"agent {args.node_id} registered with {args.head}", flush=True)
    await agent.stopped.wait()
    await asyncio.sleep(0.1)  # let the last replies leave
    await service.close()
    security.stop()
    return 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m rlactors.launch.daemons",
        description="A cluster's head or node agent (started by `rlactors up`).",
    )
    sub = ap.add_subparsers(dest="role", required=True)
    h = sub.add_parser("head", help="serve the control plane")
    h.add_argument("--bind", required=True, help="address to serve on, e.g. tcp://10.0.0.1:6380")
    h.add_argument("--secret-file", required=True, help="the cluster secret (mode 600) every peer must know")
    h.add_argument(
        "--node-timeout",
        type=float,
        default=5.0,
        help="seconds a silent node is given before it is declared dead",
    )
    h.add_argument(
        "--client-timeout",
        type=float,
        default=0.0,
        help="seconds a silent client (a driver killed outright) is given before the head stops its run's "
        "actors (0: max(10, 3 * node timeout))",
    )
    h.add_argument(
        "--fence-after",
        type=float,
        default=0.0,
        help="seconds a silent worker with restarts left is given before its agent kills and restarts it "
        "(0: node timeout + 6)",
    )
    h.add_argument(
        "--retain-finished",
        type=float,
        default=0.0,
        help="seconds a finished run's stopped actors stay listed by `rlactors status` (0: no time bound)",
    )
    h.add_argument(
        "--security",
        choices=["curve", "plain"],
        default="curve",
        help="curve: encrypted; plain: authenticated only",
    )
    max_bytes_help = "largest message between authenticated peers, in bytes (default: $RLACTORS_MAX_MESSAGE_BYTES or 1 GiB)"
    h.add_argument("--max-message-bytes", type=int, default=0, help=max_bytes_help)
    backlog_help = (
        "bytes that may wait to be sent to one peer that does not read before its senders are held back "
        "(default: $RLACTORS_SEND_BACKLOG_BYTES or 256 MiB)"
    )
    h.add_argument("--send-backlog-bytes", type=int, default=0, help=backlog_help)
    a = sub.add_parser("agent", help="start and watch the workers of one host")
    a.add_argument("--head", required=True, help="the head's address, e.g. tcp://10.0.0.1:6380")
    a.add_argument("--node-id", required=True, help="this node's unique name in the cluster")
    a.add_argument("--host", required=True, help="this host's address, reachable from the other nodes")
    a.add_argument("--secret-file", required=True, help="the cluster secret (mode 600) every peer must know")
    a.add_argument(
        "--resources", default="{}", help='JSON resources, e.g. {"cpu": 32, "gpu": 8} (detected if omitted)'
    )
    a.add_argument("--log-dir", default="", help="folder for one log file per worker (none if empty)")
    a.add_argument("--workdir", default="", help="directory the agent and its workers run in")
    a.add_argument(
        "--env", action="append", metavar="KEY=VALUE", help="set an environment variable for workers"
    )
    a.add_argument(
        "--allow-module",
        action="append",
        metavar="PREFIX",
        help="start only actor classes whose module is under this dotted prefix (repeatable; none: every module)",
    )
    a.add_argument(
        "--connect-timeout", type=float, default=60.0, help="seconds to keep trying to register with the head"
    )
    a.add_argument(
        "--security",
        choices=["curve", "plain"],
        default="curve",
        help="curve: encrypted; plain: authenticated only",
    )
    a.add_argument("--max-message-bytes", type=int, default=0, help=max_bytes_help)
    a.add_argument("--send-backlog-bytes", type=int, default=0, help=backlog_help)
    args = ap.parse_args(argv)
    if args.max_message_bytes:  # this process, and (through the environment) the workers it starts
        set_max_message_bytes(args.max_message_bytes)
    if args.send_backlog_bytes:
        set_send_backlog(args.send_backlog_bytes)
    if args.role == "agent":
        if args.workdir:
            os.chdir(Path(args.workdir).expanduser())
        for item in args.env or []:
            k, _, v = item.partition("=")
            os.environ[k] = v
        args.log_dir = Path(args.log_dir).expanduser() if args.log_dir else None
    runner = run_head if args.role == "head" else run_agent
    try:
        import uvloop

        code = uvloop.run(runner(args))
    except ImportError:
        code = asyncio.run(runner(args))
    sys.exit(code)


if __name__ == "__main__":
    main()
