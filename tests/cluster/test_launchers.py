"""`rlactors up` starting node agents for real over ssh and with srun inside a Slurm allocation.

Each test runs real daemons on this machine (a private sshd; munged + slurmctld + slurmd for a
one-node Slurm cluster; see sysdaemons.py), brings a cluster up through them from a
cluster.toml, runs an actor on the launched node, checks `rlactors status`, and checks that
`rlactors down` stops the agent that ssh/srun started. They skip, saying why, where the
daemons are not installed (`scripts/ci-system-deps.sh`) or cannot start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import rlactors
from tests.cluster import sysdaemons
from tests.cluster.sysdaemons import Slurm, Sshd, free_port, pid_alive, pids_with, wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ssh_server(tmp_path: Path) -> Iterator[Sshd]:
    with sysdaemons.sshd(tmp_path / "sshd") as server:
        yield server


@pytest.fixture
def slurm_cluster(tmp_path: Path) -> Iterator[Slurm]:
    with sysdaemons.slurm(tmp_path / "slurm") as cluster:
        yield cluster


def run_cli(args: list[str], env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlactors.launch.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RLACTORS_"))}
    return {
        **env,
        "RLACTORS_STATE_DIR": str(tmp_path / "state"),
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
        **(extra or {}),
    }


def write_config(tmp_path: Path, node_lines: str) -> Path:
    p = tmp_path / "cluster.toml"
    p.write_text(
        f"""
[head]
host = "127.0.0.1"
port = {free_port()}
node_timeout = 5.0

[cluster]
secret_file = "{tmp_path}/secret"
log_dir = "{tmp_path}/logs"
python = "{sys.executable}"
start_timeout = 60.0

[[nodes]]
{node_lines}
"""
    )
    return p


def agent_pids(node_id: str) -> list[int]:
    """The agent processes themselves (python), not the ssh/srun clients whose argv also names them."""
    pids = []
    for pid in pids_with("rlactors.launch.daemons agent --head"):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if argv[0].decode() == sys.executable and node_id.encode() in argv:
                pids.append(pid)
    return pids


async def use_node(state_dir: str, node_id: str, env_keys: list[str]) -> tuple[int, dict[str, str | None]]:
    """Run a Counter and a Member on ``node_id``; the Counter's worker pid and the Member's env."""
    os.environ["RLACTORS_STATE_DIR"] = state_dir
    try:
        cluster = await rlactors.connect()
        try:
            from tests.cluster.actors import Member
            from tests.runtime.actors import Counter

            nodes = {n["node_id"]: n for n in await cluster.nodes()}
            assert nodes[node_id]["alive"], nodes
            c = await cluster.spawn(Counter, 40, name="launched", node_id=node_id, detached=True)
            assert await c.add(2) == 42
            assert await cluster.node_of(c) == node_id
            m = await cluster.spawn(Member, node_id=node_id, detached=True)
            assert await m.node() == node_id
            return await c.pid(), await m.env(env_keys)
        finally:
            await cluster._client.close()
    finally:
        del os.environ["RLACTORS_STATE_DIR"]


@contextlib.contextmanager
def cluster_up(cfg: Path, env: dict[str, str], node_id: str) -> Iterator[subprocess.CompletedProcess[str]]:
    """`rlactors up cfg`; on the way out, `rlactors down` if still recorded, then kill any agent left."""
    up = run_cli(["up", str(cfg)], env)
    try:
        assert up.returncode == 0, f"{up.stderr}\nlogs: {_logs(cfg.parent)}"
        yield up
    finally:
        if (Path(env["RLACTORS_STATE_DIR"]) / "cluster.json").exists():
            run_cli(["down"], env)
        for pid in agent_pids(node_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{sysdaemons.tail(p)}" for p in sorted((tmp_path / "logs").glob("*.log")))


def check_status_then_down(env: dict[str, str], node_id: str, agent: int, worker: int) -> None:
    status = run_cli(["status"], env)
    assert status.returncode == 0, status.stderr
    for text in (node_id, "alive", "launched", "Counter", "Member", "ALIVE"):
        assert text in status.stdout, status.stdout
    down = run_cli(["down"], env)
    assert down.returncode == 0, down.stderr
    assert "stopped 1 node agent(s)" in down.stderr, down.stderr
    assert wait_until(lambda: not pid_alive(agent), 10), f"agent {agent} still running after `rlactors down`"
    assert wait_until(lambda: not pid_alive(worker), 10), (
        f"worker {worker} still running after `rlactors down`"
    )
    assert agent_pids(node_id) == []


def test_up_starts_the_agent_over_ssh(tmp_path: Path, ssh_server: Sshd) -> None:
    node_id = f"viassh-{uuid.uuid4().hex[:8]}"
    cfg = write_config(
        tmp_path,
        f"""host = "127.0.0.1"
node_id = "{node_id}"
launch = "ssh"
python = "{sys.executable}"
workdir = "{ROOT}"
command_prefix = ["env", "PYTHONPATH={ROOT}"]
ssh_options = {json.dumps(ssh_server.ssh_options())}
resources = {{ cpu = 2 }}
""",
    )
    env = cli_env(tmp_path)
    with cluster_up(cfg, env, node_id):
        [agent] = agent_pids(node_id)
        assert "sshd" in sysdaemons.ancestors(agent), "the agent was not started through sshd"
        worker, worker_env = asyncio.run(use_node(env["RLACTORS_STATE_DIR"], node_id, ["SSH_CONNECTION"]))
        # sshd sets SSH_CONNECTION="client_ip client_port server_ip server_port" in the session.
        assert (worker_env["SSH_CONNECTION"] or "").split()[-1] == str(ssh_server.port), worker_env
        check_status_then_down(env, node_id, agent, worker)


def test_up_starts_the_agent_with_srun_inside_an_allocation(tmp_path: Path, slurm_cluster: Slurm) -> None:
    node_id = f"viasrun-{uuid.uuid4().hex[:8]}"
    job = slurm_cluster.allocate()
    cfg = write_config(
        tmp_path,
        f"""host = "{slurm_cluster.node}"
node_id = "{node_id}"
launch = "slurm"
workdir = "{ROOT}"
resources = {{ cpu = 2 }}
""",
    )
    # What a shell from `salloc` has: the job id (and the cluster's config), so srun runs a step in it.
    env = cli_env(tmp_path, {"SLURM_CONF": slurm_cluster.env["SLURM_CONF"], "SLURM_JOB_ID": job})
    with cluster_up(cfg, env, node_id):
        [agent] = agent_pids(node_id)
        assert "slurmstepd" in sysdaemons.ancestors(agent), "the agent was not started by srun"
        assert slurm_cluster.steps(job), "no srun step is running in the allocation"
        worker, worker_env = asyncio.run(
            use_node(env["RLACTORS_STATE_DIR"], node_id, ["SLURM_JOB_ID", "SLURM_STEP_ID"])
        )
        assert worker_env["SLURM_JOB_ID"] == job and worker_env["SLURM_STEP_ID"] is not None, worker_env
        check_status_then_down(env, node_id, agent, worker)
        assert wait_until(lambda: not slurm_cluster.steps(job), 10), slurm_cluster.steps(job)
