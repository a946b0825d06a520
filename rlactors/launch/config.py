"""cluster.toml: what a cluster is made of (where to find a running one: rlactors.api.runs).

Example (see recipes/cluster.example.toml)::

    [head]
    host = "10.0.0.1"          # address agents and clients use to reach the head
    port = 6380

    [cluster]
    secret_file = "~/.rlactors/secret"   # created (mode 600) by `rlactors up` if missing
    log_dir = "~/.rlactors/logs"

    [[nodes]]
    host = "10.0.0.2"
    launch = "ssh"             # local | ssh | slurm
    python = "/opt/venv/bin/python"
    resources = { cpu = 32, gpu = 8 }
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlactors.base.tomlconf import ConfigError, load_toml

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "HeadConfig",
    "NodeConfig",
    "agent_command",
    "head_command",
    "load_cluster_config",
]


@dataclass
class HeadConfig:
    """Where the head listens. ``host`` must be reachable from every node."""

    host: str = "127.0.0.1"
    port: int = 6380
    bind: str = ""  # interface to bind; defaults to ``host``
    node_timeout: float = 5.0  # a node silent this long is declared dead
    # a driver or client silent this long is given up and its run's actors stopped (0: max(10, 3 * node_timeout))
    client_timeout: float = 0.0
    # a worker with restarts left silent this long is killed by its agent and restarted (0: node_timeout + 6)
    fence_after: float = 0.0
    # seconds `rlactors status` goes on listing a finished run's STOPPED actors after they stopped
    # (0: no time bound; the head keeps the last 100 ended actors either way)
    retain_finished: float = 0.0
    python: str = ""  # interpreter for the head; defaults to cluster.python

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"'port' must be between 1 and 65535, got {self.port}")
        if self.node_timeout <= 0:
            raise ValueError(f"'node_timeout' must be > 0 seconds, got {self.node_timeout:g}")
        if self.client_timeout < 0:
            raise ValueError(
                f"'client_timeout' must be >= 0 seconds (0: the default), got {self.client_timeout:g}"
            )
        if self.fence_after < 0:
            raise ValueError(f"'fence_after' must be >= 0 seconds (0: the default), got {self.fence_after:g}")
        if self.retain_finished < 0:
            raise ValueError(
                f"'retain_finished' must be >= 0 seconds (0: no bound), got {self.retain_finished:g}"
            )
        if not self.host:
            raise ValueError("'host' must be an address every node can reach")


@dataclass
class NodeConfig:
    """One host and how to start its agent on it."""

    host: str
    launch: Literal["local", "ssh", "slurm"] = "local"
    node_id: str = ""  # defaults to the host (with an index if hosts repeat)
    python: str = ""  # defaults to cluster.python
    resources: dict[str, float] = field(default_factory=dict)  # cpu, gpu, custom; cpu/gpu detected if omitted
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""  # directory the agent (and its workers) run in; defaults to the current one
    command_prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", "h1"]
    ssh_options: list[str] = field(default_factory=list)
    srun_options: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("'host' must not be empty")
        negative = sorted(k for k, v in self.resources.items() if v < 0)
        if negative:
            raise ValueError(f"'resources' must not be negative: {', '.join(negative)}")


@dataclass
class ClusterSection:
    name: str = "rlactors"
    secret_file: str = "~/.rlactors/secret"
    log_dir: str = "~/.rlactors/logs"
    python: str = ""  # interpreter for the head and agents; defaults to the one running `rlactors up`
    start_timeout: float = 120.0  # seconds `rlactors up` waits for every node to register
    security: Literal["curve", "plain"] = "curve"  # plain: authenticated, not encrypted (trusted networks)
    # largest message between authenticated peers, in bytes (0: RLACTORS_MAX_MESSAGE_BYTES or 1 GiB)
    max_message_bytes: int = 0
    # bytes that may wait to be sent to one peer that does not read before its senders are held back
    # (0: RLACTORS_SEND_BACKLOG_BYTES or 256 MiB; see rlactors.wire.transport)
    send_backlog_bytes: int = 0
    # dotted prefixes of the actor-class modules the agents start, e.g. ["nodes", "recipes"]; a spawn
    # of any other class is refused (empty: every module; a class in a driver script is "__main__")
    allowed_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.start_timeout <= 0:
            raise ValueError(f"'start_timeout' must be > 0 seconds, got {self.start_timeout:g}")
        if self.max_message_bytes and self.max_message_bytes < 1 << 20:
            raise ValueError(
                f"'max_message_bytes' must be at least 1048576 (1 MiB), got {self.max_message_bytes}"
            )
        if self.send_backlog_bytes < 0:
            raise ValueError(f"'send_backlog_bytes' must be >= 0 bytes, got {self.send_backlog_bytes}")


@dataclass
class ClusterConfig:
    """A whole cluster.toml."""

    nodes: list[NodeConfig]
    head: HeadConfig  # required: where agents and clients reach the head is never guessed
    cluster: ClusterSection = field(default_factory=ClusterSection)
    source: str = ""

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError(f"{self.source or 'cluster config'}: 'nodes' must list at least one node")
        self.cluster.python = self.cluster.python or sys.executable
        seen: dict[str, int] = {}
        for n in self.nodes:
            if not n.node_id:
                k = seen.get(n.host, 0)
                seen[n.host] = k + 1
                n.node_id = n.host if k == 0 else f"{n.host}-{k}"
            n.python = n.python or self.cluster.python
        ids = [n.node_id for n in self.nodes]
        dup = {x for x in ids if ids.count(x) > 1}
        if dup:
            raise ConfigError(
                f"{self.source}: duplicate node_id {sorted(dup)}; give each node a unique node_id"
            )
        self.head.bind = self.head.bind or self.head.host
        self.head.python = self.head.python or self.cluster.python

    @property
    def address(self) -> str:
        return f"tcp://{self.head.host}:{self.head.port}"


def load_cluster_config(path: str | Path, overrides: list[str] | None = None) -> ClusterConfig:
    cfg = load_toml(ClusterConfig, path, overrides)
    cfg.source = str(path)
    return cfg


def _wire_flags(cfg: ClusterConfig) -> list[str]:
    """The flags the head and every agent take alike: the sockets' security and message limits."""
    flags = ["--security", cfg.cluster.security]
    if cfg.cluster.max_message_bytes:
        flags += ["--max-message-bytes", str(cfg.cluster.max_message_bytes)]
    if cfg.cluster.send_backlog_bytes:
        flags += ["--send-backlog-bytes", str(cfg.cluster.send_backlog_bytes)]
    return flags


def head_command(cfg: ClusterConfig, secret_file: str, retain_finished: float) -> list[str]:
    """The command line that starts the head (``rlactors up`` runs it on this host)."""
    cmd = [
        cfg.head.python,
        "-m",
        "rlactors.launch.daemons",
        "head",
        "--bind",
        f"tcp://{cfg.head.bind}:{cfg.head.port}",
        "--secret-file",
        secret_file,
        "--node-timeout",
        str(cfg.head.node_timeout),
        "--client-timeout",
        str(cfg.head.client_timeout),
        "--fence-after",
        str(cfg.head.fence_after),
        *_wire_flags(cfg),
    ]
    if retain_finished:
        cmd += ["--retain-finished", str(retain_finished)]
    return cmd


def agent_command(cfg: ClusterConfig, node: NodeConfig, secret_file: str, log_dir: str) -> list[str]:
    """The command line that starts ``node``'s agent, through ssh or srun when configured."""
    inner = [
        node.python,
        "-m",
        "rlactors.launch.daemons",
        "agent",
        "--head",
        cfg.address,
        "--node-id",
        node.node_id,
        "--host",
        node.host,
        "--secret-file",
        secret_file,
        "--log-dir",
        log_dir,
        "--resources",
        json.dumps(node.resources),
        *_wire_flags(cfg),
    ]
    for prefix in cfg.cluster.allowed_modules:
        inner += ["--allow-module", prefix]
    for k, v in sorted(node.env.items()):
        inner += ["--env", f"{k}={v}"]
    if node.workdir:
        inner += ["--workdir", node.workdir]
    if node.launch == "local":
        return [*node.command_prefix, *inner]
    if node.launch == "ssh":
        remote = " ".join(shlex.quote(x) for x in [*node.command_prefix, *inner])
        # -tt: a pseudo-terminal, so the remote agent gets a hang-up if this ssh client dies.
        return ["ssh", "-tt", "-o", "BatchMode=yes", *node.ssh_options, node.host, remote]
    # slurm: one task on that node, inside the current allocation.
    return [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node.host}",
        "--overlap",
        *node.srun_options,
        *node.command_prefix,
        *inner,
    ]
