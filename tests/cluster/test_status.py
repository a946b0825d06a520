"""`rlactors status` for operators: when each node and actor was last heard from, what each actor
is doing, live ones before dead ones; `--json` for scripts and `--watch`; a finished run's stopped
actors dropped after the head's retention window (`rlactors up --retain-finished`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import rlactors
from rlactors.head.head import Head
from rlactors.head.registry import ActorRecord
from rlactors.launch.config import load_cluster_config
from tests.cluster.actors import Blob
from tests.cluster.test_cli import one_node_config, run_cli, write_config
from tests.helpers.processes import cmdline
from tests.runtime.actors import Counter

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def up(tmp_path: Path, cli_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """A cluster of one local node started with `rlactors up` (no `python` key: the default)."""
    cfg = one_node_config(tmp_path, "n1", cpu=4)  # the default node_timeout: a loaded machine's stalls pass
    started = run_cli(["up", str(cfg)], cli_env)
    try:
        assert started.returncode == 0, started.stderr
        yield cli_env
    finally:
        down = run_cli(["down"], cli_env)
        assert down.returncode == 0, down.stderr


def test_cluster_python_defaults_to_the_interpreter_running_up(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, '[head]\nhost = "127.0.0.1"\n\n[[nodes]]\nhost = "127.0.0.1"\n')
    c = load_cluster_config(cfg)
    assert c.cluster.python == c.head.python == c.nodes[0].python == sys.executable


def _status(env: dict[str, str]) -> dict:
    res = run_cli(["status", "--json"], env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_status_json_says_who_was_heard_from_when_and_what_each_actor_is_doing(up: dict[str, str]) -> None:
    pids: dict[str, int] = {}

    async def populate() -> None:
        os.environ["RLACTORS_STATE_DIR"] = up["RLACTORS_STATE_DIR"]
        try:
            cluster = await rlactors.connect()
            gone = await cluster.spawn(Counter, name="gone", detached=True)
            await cluster.kill(gone)
            idle = await cluster.spawn(Counter, name="idle", detached=True)
            busy = await cluster.spawn(Counter, name="busy", detached=True)
            stopped = await cluster.spawn(Counter, name="stopped", detached=True)
            blocked = await cluster.spawn(Blob, name="blocked", detached=True)
            blocked.block_loop.tell(600)
            busy.sleep.tell(600)
            busy.sleep.tell(600)
            assert await busy.add(1) == 1  # calls arrive in order: both sleeps have started
            for h in (idle, busy, stopped):
                pids[h.actor_id] = await h.pid()
            await cluster._client.close()
        finally:
            del os.environ["RLACTORS_STATE_DIR"]

    asyncio.run(populate())
    stopped_pid = next(pid for pid in pids.values() if "rlactors.node.worker stopped" in cmdline(pid))
    os.kill(stopped_pid, signal.SIGSTOP)
    try:
        status = _status(up)
        (node,) = status["nodes"]
        assert node["node_id"] == "n1" and node["alive"] and 0 <= node["heard_s"] < 3.0
        actors = {a["name"]: a for a in status["actors"]}
        assert [a["name"] for a in status["actors"]][-1] == "gone"  # live ones first
        # killed by its owner: STOPPED, with who stopped it (DEAD is for deaths nobody asked for)
        assert actors["gone"]["state"] == "STOPPED" and actors["gone"]["heard_s"] is None
        assert actors["gone"]["stopped_by"].startswith("driver-")
        assert actors["idle"]["activity"] == {"running": 0, "oldest_method": None, "oldest_s": 0.0}
        assert actors["idle"]["heard_s"] == 0.0
        busy = actors["busy"]["activity"]
        assert busy["running"] == 2 and busy["oldest_method"] == "sleep" and busy["oldest_s"] > 0
        # A blocked event loop says nothing, but its process answers pings (the transport's ping thread).
        deadline = time.monotonic() + 30
        while (b := {x["name"]: x for x in _status(up)["actors"]}["blocked"])["activity"] is not None:
            assert time.monotonic() < deadline, b  # not blocked yet: the told call is on its way
        assert b["heard_s"] == 0.0
        # A stopped worker is ALIVE to the head, but says nothing: the status shows it.
        deadline = time.monotonic() + 30
        while (a := {x["name"]: x for x in _status(up)["actors"]}["stopped"])["heard_s"] in (0.0, None):
            assert time.monotonic() < deadline, a
        assert a["state"] == "ALIVE" and a["activity"] is None and a["heard_s"] >= 6.0
        table = run_cli(["status"], up)
        assert table.returncode == 0, table.stderr
        for text in (
            "last heard",
            "not answering",
            "a blocked event loop?",
            "running 2 calls; oldest sleep for",
            "idle",
            "STOPPED",
        ):
            assert text in table.stdout, table.stdout
    finally:
        os.kill(stopped_pid, signal.SIGCONT)


def test_status_watch_prints_a_json_line_per_refresh_until_interrupted(up: dict[str, str]) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlactors.launch.cli", "status", "--json", "--watch", "0.2"],
        env=up,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first, second = (json.loads(proc.stdout.readline()) for _ in range(2))
        assert first["nodes"][0]["node_id"] == second["nodes"][0]["node_id"] == "n1"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


async def test_a_finished_runs_stopped_actors_are_dropped_after_the_retention_window() -> None:
    now = time.monotonic()

    def record(head: Head, name: str, run: str, ago: float, state: str = "DEAD", by: str = "its run") -> None:
        rec = ActorRecord(name, name, "C", {}, {}, run, False, run, 0, state=state, stopped_by=by)
        rec.since = now - ago  # when it stopped (its state last changed)
        head.actors[name] = rec

    def fill(head: Head) -> Head:
        record(head, "old", "driver-a", 61)  # its run finished, stopped past the window: dropped
        record(head, "recent", "driver-a", 10)  # within the window: listed
        record(head, "died", "driver-a", 600, by="")  # DEAD, nobody asked: kept with its cause
        record(head, "of-a-live-run", "driver-b", 600)  # stopped, but its run goes on: listed
        record(head, "alive", "driver-a", 600, state="ALIVE", by="")
        head.clients["driver-b"] = {"run": "driver-b"}
        return head

    status = await fill(Head(retain_finished=60.0)).status()
    assert {a["name"]: a["state"] for a in status["actors"]} == {
        "alive": "ALIVE",
        "died": "DEAD",
        "recent": "STOPPED",
        "of-a-live-run": "STOPPED",
    }
    assert status["retain_finished_s"] == 60.0
    status = await fill(Head()).status()  # the default: no time bound, as before
    assert "old" in {a["name"] for a in status["actors"]} and status["retain_finished_s"] == 0.0


def test_rlactors_up_retain_finished_reaches_the_head(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """The window set on `rlactors up` is the head's: `status` says it, and drops a finished run's
    stopped actor once it has passed."""
    cfg = one_node_config(tmp_path, "n1", cpu=2)
    started = run_cli(["up", str(cfg), "--retain-finished", "1"], cli_env)
    try:
        assert started.returncode == 0, started.stderr

        async def a_run_that_ends() -> None:
            os.environ["RLACTORS_STATE_DIR"] = cli_env["RLACTORS_STATE_DIR"]
            try:
                cluster = await rlactors.connect()
                await cluster.spawn(Counter, name="of-an-ended-run")
                await cluster.close()  # the run ends: the head stops its actors
            finally:
                del os.environ["RLACTORS_STATE_DIR"]

        asyncio.run(a_run_that_ends())
        status = _status(cli_env)
        assert status["retain_finished_s"] == 1.0
        table = run_cli(["status"], cli_env)
        assert "a finished run's stopped actors are dropped 1.0s after they stop" in table.stdout, (
            table.stdout
        )
        deadline = time.monotonic() + 60
        while any(a["name"] == "of-an-ended-run" for a in status["actors"]):
            assert time.monotonic() < deadline, status
            status = _status(cli_env)
    finally:
        down = run_cli(["down"], cli_env)
        assert down.returncode == 0, down.stderr
