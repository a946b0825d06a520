"""The embedded local cluster: a head and one node agent on the driver's own event loop."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlactors.api.cluster import Cluster, ClusterStarter
from rlactors.api.runs import RunRecord, runs_dir, write_run
from rlactors.base import logging as rlog
from rlactors.head.head import Head
from rlactors.node.agent import NodeAgent
from rlactors.wire.runtime import RuntimeClient, set_current
from rlactors.wire.security import Security, load_secret, new_secret, new_secret_file
from rlactors.wire.service import Service

__all__ = ["LocalCluster", "detect_gpus", "init", "new_session_dir", "start_local"]

SESSION_ROOT = Path("/tmp")


def new_session_dir(prefix: str) -> Path:
    """A private (mode 700) folder ``/tmp/<prefix>*`` for this process's sockets, marked with its pid.

    Its owner removes it on a clean stop; folders whose owner died without doing so (SIGKILL)
    are removed here, the next time a session starts.
    """
    _remove_orphaned_sessions()
    session = Path(tempfile.mkdtemp(prefix=prefix, dir=SESSION_ROOT))
    os.chmod(session, 0o700)
    (session / "owner").write_text(f"{os.getpid()} {_pid_namespace()}")
    return session


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _remove_orphaned_sessions() -> None:
    ours = _pid_namespace()
    for session in SESSION_ROOT.glob("rlx-*"):
        try:
            pid, namespace = (session / "owner").read_text().split(" ", 1)
            # Only our own folders, and only where pids mean the same as here.
            if session.stat().st_uid != os.getuid() or not ours or namespace != ours:
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(session, ignore_errors=True)
        except (OSError, ValueError):  # no owner file, someone else's, or alive
            continue


def detect_gpus() -> int:
    """Number of NVIDIA GPUs visible on this host (0 when there is no driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


class LocalCluster:
    """The head and node agent of an embedded cluster, running on the driver's loop."""

    def __init__(
        self,
        service: Service,
        head: Head,
        agent: NodeAgent,
        session_dir: Path,
        secret_file: str | None,
        secret: bytes | None = None,
        mechanism: str = "curve",
    ) -> None:
        self.service, self.head, self.agent, self.session_dir = service, head, agent, session_dir
        self.secret_file = secret_file
        self._secret, self.mechanism = secret, mechanism  # the in-memory secret (ipc), if so
        self.records: list[RunRecord] = []  # where this run is recorded (removed at shutdown)

    def record(self, folder: Path) -> RunRecord:
        """Record how to reach this cluster in ``folder`` (see :mod:`rlactors.api.runs`)."""
        rec = write_run(folder, self.service.address, self.mechanism, self._secret, self.secret_file)
        if self.records:  # the state folder's record names the run folder too
            state = self.records[0]
            self.records[0] = write_run(
                state.folder,
                self.service.address,
                self.mechanism,
                self._secret,
                self.secret_file,
                str(folder),
            )
        self.records.append(rec)
        return rec

    async def shutdown(self, client: RuntimeClient) -> None:
        for rec in self.records:  # no longer reachable: the credential goes first
            rec.remove()
        self.records.clear()
        await self.agent.stop(grace=3.0)  # SIGTERM first: on_stop hooks (e.g. stopping a server) run
        await client.close()
        await self.head.stop()
        await self.service.close()
        if self.head.security is not None:
            self.head.security.stop()
        shutil.rmtree(self.session_dir, ignore_errors=True)


async def start_local(
    resources: dict[str, float] | None,
    address: str,
    secret_file: str | None,
    node_timeout: float,
    log_sink: Any,
    client_timeout: float | None = None,
    mechanism: str = "curve",
    allowed_modules: Sequence[str] | None = None,
) -> tuple[RuntimeClient, LocalCluster]:
    rlog.ensure_logging()
    session_dir = new_session_dir("rlx-")
    security = None
    secret: bytes | None = None
    if address.startswith("tcp://"):
        # Over TCP every peer must authenticate; make a secret for this session if none given.
        secret_file = secret_file or str(new_secret_file(session_dir / "secret"))
        security = Security(load_secret(secret_file), mechanism)
        bind = address
        transport, host = "tcp", address.removeprefix("tcp://").rsplit(":", 1)[0]
    elif address == "ipc":
        # Over ipc the session directory (mode 700) keeps other users out; a secret kept in this
        # process's memory tells our workers (call credential) from us (control). PLAIN: no encryption.
        bind, transport, host = f"ipc://{session_dir}/head", "ipc", "127.0.0.1"
        secret_file = None
        secret = new_secret()
        security = Security(secret, "plain")
    else:
        raise ValueError(f"address must be 'ipc' or 'tcp://HOST:PORT', not {address!r}")
    total = {"cpu": float(os.cpu_count() or 1), "gpu": float(detect_gpus())}
    total.update({k: float(v) for k, v in (resources or {}).items()})
    service = Service(name="head", max_concurrency=None, security=security)
    head = Head(security, node_timeout=node_timeout, client_timeout=client_timeout)
    head_address = service.bind(bind)
    service.add("head", head)
    head.start()
    agent = NodeAgent(
        "local",
        head_address,
        host=host,
        resources=total,
        session_dir=session_dir,
        transport=transport,
        security=security,
        allowed_modules=allowed_modules,
        **({"log_sink": log_sink} if log_sink else {}),
    )
    service.add("agent", agent)
    head.in_process.add(agent.node_id)
    local = LocalCluster(
        service, head, agent, session_dir, secret_file, secret, "plain" if secret is not None else mechanism
    )
    client = RuntimeClient(head_address, security)
    head.sessions.in_process.add(client.client_id)
    try:
        await agent.start(head_address)
        await client.start()
    except BaseException:  # any exit stops what was started, then re-raises
        await local.shutdown(client)
        raise
    set_current(client)
    # reachable by `rlactors status|stack|pool` (the only live run, or --run): removed at shutdown
    with contextlib.suppress(OSError):  # a state folder we cannot write: only --run can find it
        local.record(runs_dir() / session_dir.name)
    return client, local


def init(
    *,
    resources: dict[str, float] | None = None,
    address: str = "ipc",
    secret_file: str | None = None,
    node_timeout: float = 5.0,
    log_sink: Any = None,
    client_timeout: float | None = None,
    security: str = "curve",
    allowed_modules: Sequence[str] | None = None,
) -> ClusterStarter:
    """Start an embedded local cluster (head + one node agent) on the running loop.

    ``address="ipc"`` (default) serves over Unix sockets in a private directory, with peers
    authenticated by a secret this process keeps in memory (PLAIN: nothing is encrypted);
    ``address="tcp://127.0.0.1:0"`` serves over TCP with CURVE authentication, so other
    processes can :func:`connect` with the secret. Non-detached actors of a client that
    stops heartbeating for ``client_timeout`` seconds (default max(10, 3 * node_timeout))
    are stopped. ``security="plain"`` authenticates TCP peers without encrypting traffic
    (trusted networks only; see :class:`rlactors.wire.security.Security`). ``allowed_modules`` (dotted
    prefixes, e.g. ``["nodes", "recipes"]``) limits the actor classes the node starts; default:
    every module. Use as ``async with rlactors.init() as c``
    or ``c = await rlactors.init()`` … ``await c.close()``.
    """

    async def _init() -> Cluster:
        client, local = await start_local(
            resources, address, secret_file, node_timeout, log_sink, client_timeout, security, allowed_modules
        )
        return Cluster(client, local=local)

    return ClusterStarter(_init)
