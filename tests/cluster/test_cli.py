"""`rlactors up` / `status` / `down` end to end from a cluster.toml with two local hosts."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import rlactors
import rlactors.wire.security

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlactors.launch.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_config(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "cluster.toml"
    p.write_text(body)
    return p


def one_node_config(tmp_path: Path, node_id: str = "solo", cpu: int = 2, head_extra: str = "") -> Path:
    """A cluster.toml of one local node on a free port, its secret and logs under ``tmp_path``."""
    return write_config(
        tmp_path,
        f"""
[head]
host = "127.0.0.1"
port = {free_port()}
{head_extra}
[cluster]
secret_file = "{tmp_path}/secret"
log_dir = "{tmp_path}/logs"

[[nodes]]
host = "127.0.0.1"
node_id = "{node_id}"
resources = {{ cpu = {cpu} }}
""",
    )


def test_up_status_down_with_two_local_hosts(tmp_path: Path, cli_env: dict[str, str]) -> None:
    port = free_port()
    cfg = write_config(
        tmp_path,
        f"""
[head]
host = "127.0.0.1"
port = {port}

[cluster]
secret_file = "{tmp_path}/secret"
log_dir = "{tmp_path}/logs"
python = "{sys.executable}"

[[nodes]]
host = "127.0.0.1"
node_id = "hostA"
resources = {{ cpu = 2, gpu = 0, special = 1 }}

[[nodes]]
host = "127.0.0.1"
node_id = "hostB"
resources = {{ cpu = 2 }}
""",
    )
    before = set(Path("/tmp").glob("rlx-host[AB]-*"))
    up = run_cli(["up", str(cfg)], cli_env)
    try:
        assert up.returncode == 0, up.stderr
        assert set(Path("/tmp").glob("rlx-host[AB]-*")) - before  # the agents' session folders
        assert "cluster up" in up.stderr
        assert (tmp_path / "secret").stat().st_mode & 0o777 == 0o600

        async def use_cluster() -> None:
            os.environ["RLACTORS_STATE_DIR"] = cli_env["RLACTORS_STATE_DIR"]
            try:
                cluster = await rlactors.connect()
                from tests.runtime.actors import Counter

                a = await cluster.spawn(Counter, 1, name="on-a", resources={"special": 1}, detached=True)
                b = await cluster.spawn(Counter, 2, name="on-b", node_id="hostB", detached=True)
                assert await a.add(1) == 2 and await b.add(1) == 3
                assert await cluster.node_of(a) == "hostA" and await cluster.node_of(b) == "hostB"
                with pytest.raises(rlactors.PlacementError, match="special"):
                    await cluster.spawn(Counter, resources={"special": 1})
                await cluster._client.close()
            finally:
                del os.environ["RLACTORS_STATE_DIR"]

        asyncio.run(use_cluster())
        status = run_cli(["status"], cli_env)
        assert status.returncode == 0, status.stderr
        for text in ("hostA", "hostB", "alive", "on-a", "on-b", "Counter", "ALIVE", "special 1/1"):
            assert text in status.stdout, status.stdout
        secret = (tmp_path / "secret").read_text().strip()
        assert secret not in status.stdout + status.stderr + up.stdout + up.stderr
        for log in (tmp_path / "logs").glob("*.log"):
            assert secret not in log.read_text()
    finally:
        down = run_cli(["down"], cli_env)
    assert down.returncode == 0, down.stderr
    assert "cluster down" in down.stderr
    assert not (Path(cli_env["RLACTORS_STATE_DIR"]) / "cluster.json").exists()
    assert not set(Path("/tmp").glob("rlx-host[AB]-*")) - before  # removed when the agents stopped
    again = run_cli(["status"], cli_env)
    assert again.returncode == 1 and "no cluster address" in again.stderr


def test_up_with_a_typo_names_the_key_and_file(tmp_path: Path, cli_env: dict[str, str]) -> None:
    cfg = write_config(
        tmp_path,
        """
[[nodes]]
hots = "127.0.0.1"
""",
    )
    res = run_cli(["up", str(cfg)], cli_env)
    assert res.returncode == 1
    assert "unknown key 'nodes[0].hots'" in res.stderr and "did you mean 'host'" in res.stderr
    assert str(cfg) in res.stderr


def test_up_names_the_host_whose_agent_failed(tmp_path: Path, cli_env: dict[str, str]) -> None:
    port = free_port()
    cfg = write_config(
        tmp_path,
        f"""
[head]
port = {port}
[cluster]
secret_file = "{tmp_path}/secret"
log_dir = "{tmp_path}/logs"
python = "{sys.executable}"
[[nodes]]
host = "127.0.0.1"
node_id = "good"
[[nodes]]
host = "127.0.0.1"
node_id = "broken"
python = "/nonexistent/python3"
""",
    )
    res = run_cli(["up", str(cfg)], cli_env)
    assert res.returncode == 1
    assert "broken" in res.stderr and "127.0.0.1" in res.stderr
    # Nothing is left running or recorded.
    assert not (Path(cli_env["RLACTORS_STATE_DIR"]) / "cluster.json").exists()


def test_agent_commands_for_ssh_and_slurm(tmp_path: Path) -> None:
    from rlactors.launch.config import agent_command, load_cluster_config

    cfg_path = write_config(
        tmp_path,
        """
[head]
host = "10.0.0.1"
port = 7000
[cluster]
python = "/opt/venv/bin/python"
[[nodes]]
host = "gpu-a"
launch = "ssh"
ssh_options = ["-p", "2222"]
resources = { gpu = 8 }
env = { NCCL_DEBUG = "WARN" }
[[nodes]]
host = "gpu-b"
launch = "slurm"
workdir = "/scratch/run"
""",
    )
    cfg = load_cluster_config(cfg_path)
    ssh = agent_command(cfg, cfg.nodes[0], "/s/secret", "/s/logs")
    assert ssh[:6] == ["ssh", "-tt", "-o", "BatchMode=yes", "-p", "2222"] and ssh[6] == "gpu-a"
    assert (
        "/opt/venv/bin/python -m rlactors.launch.daemons agent --head tcp://10.0.0.1:7000 --node-id gpu-a"
        in ssh[7]
    )
    assert "--env NCCL_DEBUG=WARN" in ssh[7] and "'{\"gpu\": 8.0}'" in ssh[7]
    srun = agent_command(cfg, cfg.nodes[1], "/s/secret", "/s/logs")
    assert srun[:5] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=gpu-b", "--overlap"]
    assert srun[srun.index("--workdir") + 1] == "/scratch/run"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[head]\nhost = "h"\n', "missing required key 'nodes'"),
        ('[[nodes]]\nhost = "a"', "missing required table [head]"),
        ('nodes = []\n[head]\nhost = "h"', "at least one node"),
        ('[head]\nnode_timeout = -1\n[[nodes]]\nhost = "a"', "'head.node_timeout' must be > 0 seconds"),
        ('[head]\nclient_timeout = -1\n[[nodes]]\nhost = "a"', "'head.client_timeout' must be >= 0 seconds"),
        ('[head]\nport = 70000\n[[nodes]]\nhost = "a"', "'head.port' must be between 1 and 65535"),
        (
            '[head]\n[cluster]\nstart_timeout = 0\n[[nodes]]\nhost = "a"',
            "'cluster.start_timeout' must be > 0",
        ),
        (
            '[head]\n[[nodes]]\nhost = "a"\nresources = { gpu = -1 }',
            "'nodes[0].resources' must not be negative: gpu",
        ),
        ('[[nodes]]\nhost = "a"\nresources = { cpu = "many" }', "'nodes[0].resources.cpu' must be a float"),
        ('[[nodes]]\nhost = "a"\nlaunch = "telnet"', "'nodes[0].launch' must be 'local' or 'ssh' or 'slurm'"),
        ('[head]\n[[nodes]]\nhost = "a"\n[[nodes]]\nhost = "b"\nnode_id = "a"', "duplicate node_id"),
        ("[[nodes]\nhost=", "not valid TOML"),
    ],
)
def test_bad_cluster_toml_errors_name_the_key_and_file(tmp_path: Path, body: str, message: str) -> None:
    from rlactors.launch.config import ConfigError, load_cluster_config

    p = write_config(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_cluster_config(p)
    assert message in str(info.value) and str(p) in str(info.value)


def _record(cli_env: dict[str, str], text: str) -> Path:
    sf = Path(cli_env["RLACTORS_STATE_DIR"]) / "cluster.json"
    sf.parent.mkdir(parents=True, exist_ok=True)
    sf.write_text(text)
    return sf


def test_an_unreadable_cluster_record_is_reported_and_down_clears_it(
    tmp_path: Path, cli_env: dict[str, str]
) -> None:
    sf = _record(cli_env, '{"address": "tcp://127.0.0.1:1", ')
    cfg = write_config(tmp_path, '[head]\n[[nodes]]\nhost = "127.0.0.1"\n')
    for args in (["status"], ["up", str(cfg)]):
        res = run_cli(args, cli_env)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert f"the cluster record {sf} is unreadable" in res.stderr.replace("\n", ""), res.stderr
    down = run_cli(["down"], cli_env)
    assert "Traceback" not in down.stderr and not sf.exists(), down.stderr


def test_down_with_a_dead_head_stops_the_agents_at_once(tmp_path: Path, cli_env: dict[str, str]) -> None:
    secret = tmp_path / "secret"
    rlactors.wire.security.new_secret_file(secret)
    # Stand-ins for agents whose head is gone (their command line names rlactors.launch.daemons).
    agents = [
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)", "rlactors.launch.daemons"],
            start_new_session=True,
        )
        for _ in range(5)
    ]
    try:
        state = {
            "address": f"tcp://127.0.0.1:{free_port()}",
            "secret_file": str(secret),
            "head_pid": 2**22 + 1,  # no such process
            "agents": {f"n{i}": {"pid": p.pid} for i, p in enumerate(agents)},
        }
        sf = _record(cli_env, json.dumps(state))
        status = run_cli(["status"], cli_env)
        assert status.returncode == 1 and "is not running" in status.stderr, status.stderr
        down = run_cli(["down"], cli_env, timeout=40)  # before: 10 s of waiting per agent
        assert down.returncode == 0 and "cluster down" in down.stderr, down.stderr
        assert all(p.wait(10) is not None for p in agents) and not sf.exists()
    finally:
        for p in agents:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_stack_prints_the_wait_cycle_of_an_up_cluster(tmp_path: Path, cli_env: dict[str, str]) -> None:
    cfg = one_node_config(tmp_path)
    up = run_cli(["up", str(cfg)], cli_env)
    try:
        assert up.returncode == 0, up.stderr

        async def make_a_cycle() -> None:
            from tests.runtime.test_forensics import report_when, start_cycle

            os.environ["RLACTORS_STATE_DIR"] = cli_env["RLACTORS_STATE_DIR"]
            try:
                cluster = await rlactors.connect()
                fa = await start_cycle(cluster, detached=True)
                fa.f.tell()  # fa.f → fb.g → fa.h, queued behind fa.f: stuck for good
                await report_when(
                    cluster, lambda r: bool(r.cycles) and all(e.state != "unseen" for e in r.edges), 5.0
                )
                await cluster._client.close()
            finally:
                del os.environ["RLACTORS_STATE_DIR"]

        asyncio.run(make_a_cycle())
        stack = run_cli(["stack"], cli_env)
        assert stack.returncode == 0, stack.stderr
        for text in (
            "wait cycle: fa → fb → fa",
            "fa.f waits on fb.g (running there",
            "fb.g waits on fa.h (queued there behind max_concurrency=1",
            "return await self.peer.g()",  # fa.f's await chain
        ):
            assert text in stack.stdout, stack.stdout
        one = run_cli(["stack", "fb"], cli_env)
        assert one.returncode == 0 and "fb (Pong" in one.stdout and "fa (Ping" not in one.stdout, one.stdout
    finally:
        down = run_cli(["down"], cli_env)
    assert down.returncode == 0, down.stderr
