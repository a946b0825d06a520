"""A stalled head still declares dead a node that really died meanwhile, within its bound, and
only that node: silence is counted over time the head was awake (rlactors.base.awake)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

import rlactors
from rlactors.base.aio import wait_for
from tests.cluster.test_cli import free_port, run_cli, write_config

ROOT = Path(__file__).resolve().parents[2]
# The head's stop (3x this) stays under the transport's 6 s silence timeout (its pings), so that this test's
# client keeps its connection to the head: what is tested is the head's judgement.
NODE_TIMEOUT = 1.5
# After the head wakes: node_timeout of its awake time, plus a check period and slack for load.
BOUND_S = NODE_TIMEOUT + 2.0


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "RLACTORS_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}


def test_a_stopped_head_wakes_and_declares_dead_only_the_node_that_died(
    tmp_path: Path, cli_env: dict[str, str]
) -> None:
    cfg = write_config(
        tmp_path,
        f"""
[head]
host = "127.0.0.1"
port = {free_port()}
node_timeout = {NODE_TIMEOUT}

[cluster]
secret_file = "{tmp_path}/secret"
log_dir = "{tmp_path}/logs"
python = "{sys.executable}"

[[nodes]]
host = "127.0.0.1"
node_id = "stays"

[[nodes]]
host = "127.0.0.1"
node_id = "dies"
""",
    )

    async def scenario(head_pid: int, dying_agent: int) -> None:
        from tests.runtime.actors import Counter

        cluster = await rlactors.connect()
        try:
            stays = await cluster.spawn(Counter, node_id="stays", detached=True)
            dies = await cluster.spawn(Counter, node_id="dies", detached=True)
            assert await stays.add(1) == 1 and await dies.add(1) == 1
            os.kill(head_pid, signal.SIGSTOP)
            try:
                os.kill(dying_agent, signal.SIGKILL)  # its worker dies with it
                await asyncio.sleep(3 * NODE_TIMEOUT)  # the scenario: the head is not running
            finally:
                os.kill(head_pid, signal.SIGCONT)
            woke = time.monotonic()
            while True:
                nodes = {n["node_id"]: n["alive"] for n in await wait_for(cluster.nodes(), 10)}
                if not nodes["dies"]:
                    break
                assert time.monotonic() - woke < BOUND_S, "the dead node was not declared dead in time"
                await asyncio.sleep(0.1)
            assert nodes["stays"], "a live node was declared dead because the head had been stopped"
            assert await wait_for(stays.add(1), 10) == 2
            with pytest.raises(rlactors.ActorDiedError, match="dies"):
                await wait_for(dies.add(1), 10)
        finally:
            await cluster._client.close()

    up = run_cli(["up", str(cfg)], cli_env)
    os.environ["RLACTORS_STATE_DIR"] = cli_env["RLACTORS_STATE_DIR"]
    try:
        assert up.returncode == 0, up.stderr
        state = json.loads((Path(cli_env["RLACTORS_STATE_DIR"]) / "cluster.json").read_text())
        asyncio.run(scenario(state["head_pid"], state["agents"]["dies"]["pid"]))
    finally:
        del os.environ["RLACTORS_STATE_DIR"]
        down = run_cli(["down"], cli_env)
        assert down.returncode == 0, down.stderr
