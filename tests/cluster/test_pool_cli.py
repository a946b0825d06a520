"""`rlactors pool` against a `rlactors up` cluster: ls, launch, add, rm on an inference-pool actor
(sim reference servers), and a clear error when the cluster has no pool."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx

import rlactors
from tests.cluster.test_cli import free_port, one_node_config, run_cli


def servers(env: dict[str, str]) -> dict[str, dict]:
    ls = run_cli(["pool", "ls", "--json"], env)
    assert ls.returncode == 0, ls.stderr
    return {s["url"]: s for s in json.loads(ls.stdout)["servers"]}


def test_pool_ls_launch_add_rm_on_an_up_cluster(tmp_path: Path, cli_env: dict[str, str]) -> None:
    cfg = one_node_config(tmp_path, cpu=8)
    up = run_cli(["up", str(cfg)], cli_env)
    try:
        assert up.returncode == 0, up.stderr
        none = run_cli(["pool", "ls"], cli_env)
        assert none.returncode == 1 and "no inference-pool actor in this cluster" in none.stderr, none.stderr

        async def start_pool() -> None:
            from nodes.inference.launcher import ReferenceServerConfig
            from nodes.inference.pool import POOL_NAME, InferencePool, PoolConfig

            os.environ["RLACTORS_STATE_DIR"] = cli_env["RLACTORS_STATE_DIR"]
            try:
                cluster = await rlactors.connect()
                pool = await cluster.spawn(
                    InferencePool,
                    PoolConfig(server=ReferenceServerConfig(backend="sim")),
                    name=POOL_NAME,
                    detached=True,
                    control=True,
                )
                await pool.start(1)
                # this driver's run ends here: the detached pool and the server it launched live on
                # (a detached actor's spawns are its own, not the run's that spawned it)
                await cluster.close()
            finally:
                del os.environ["RLACTORS_STATE_DIR"]

        asyncio.run(start_pool())
        (first,) = servers(cli_env).values()
        assert first["state"] == "live" and first["name"] == "server-0" and first["node"] == "solo"

        launch = run_cli(["pool", "launch", "1", "--node", "solo"], cli_env)
        assert launch.returncode == 0, launch.stderr
        assert "joining" in launch.stdout
        launched = next(u for u, s in servers(cli_env).items() if s["name"] == "server-1")
        assert httpx.get(f"{launched}/health", timeout=30).status_code == 200  # running, not yet serving
        assert servers(cli_env)[launched]["state"] == "joining"

        bad = run_cli(["pool", "add", f"http://127.0.0.1:{free_port()}"], cli_env)
        assert bad.returncode == 1 and "does not answer 200" in bad.stderr, bad.stderr
        table = run_cli(["pool", "ls"], cli_env)
        assert table.returncode == 0 and "joining" in table.stdout and "live" in table.stdout, table.stdout

        last = run_cli(["pool", "rm", first["url"]], cli_env)  # the only live server: refused
        assert last.returncode == 1 and "last live server" in last.stderr, last.stderr
        rm = run_cli(["pool", "rm", launched], cli_env)  # never served: removed and stopped at once
        assert rm.returncode == 0, rm.stderr
        assert launched not in servers(cli_env)
        try:
            httpx.get(f"{launched}/health", timeout=5)
            raise AssertionError(f"{launched} still answers after rm")
        except httpx.HTTPError:
            pass
    finally:
        down = run_cli(["down"], cli_env)
    assert down.returncode == 0, down.stderr
