"""However a run on an `rlactors up` cluster ends, the actors it spawned (and those its actors
spawned) are stopped and their names freed, and `status` shows them STOPPED with who stopped them;
a death nobody asked for stays DEAD. A name held by a live run is an error naming that run and how
to end it. (Issue 39, items 2 and 4.)"""

from __future__ import annotations

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

from tests.cluster.test_cli import one_node_config, run_cli

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests/cluster/run_driver.py"
CLIENT_TIMEOUT_S = 10.0  # the fixture's [head] client_timeout (the default would be 15)


@pytest.fixture
def up(tmp_path: Path, cli_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """A cluster of one local node started with `rlactors up`, with the default node_timeout (a node
    silent for 5 s is declared dead, its actors with it) and a shorter client_timeout."""
    cfg = one_node_config(tmp_path, "n1", cpu=4, head_extra=f"client_timeout = {CLIENT_TIMEOUT_S}")
    started = run_cli(["up", str(cfg)], cli_env)
    try:
        assert started.returncode == 0, started.stderr
        yield cli_env
    finally:
        down = run_cli(["down"], cli_env)
        assert down.returncode == 0, down.stderr


def _driver(env: dict[str, str], mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(DRIVER), mode],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@contextlib.contextmanager
def _running(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``proc``, killed on the way out if it is still running (a failed assertion)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _leave(proc: subprocess.Popen[str]) -> str:
    """Tell a driver waiting on stdin to leave; its stderr, once it has exited 0."""
    assert proc.stdin is not None
    proc.stdin.write("end\n")
    proc.stdin.flush()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    return err


def _ready(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:1] == ["ready"], (
        line,
        proc.stderr.read() if proc.poll() is not None and proc.stderr else "",
    )
    return int(line[1])


def _actors(env: dict[str, str]) -> list[dict]:
    res = run_cli(["status", "--json"], env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["actors"]


def _run_actors(env: dict[str, str], run: str) -> dict[str, dict]:
    return {a["name"]: a for a in _actors(env) if a["run"] == run}


@pytest.mark.parametrize("end", ["done", "error", "sigterm", "sigint", "sigkill"])
def test_however_a_run_ends_its_actors_are_stopped_and_the_next_run_starts(
    up: dict[str, str], end: str
) -> None:
    first = _driver(up, {"sigterm": "signal", "sigint": "signal", "sigkill": "signal"}.get(end, end))
    try:
        victim = _ready(first)
        os.kill(victim, signal.SIGKILL)  # a death nobody asked for, during the run
        (run,) = {a["run"] for a in _actors(up) if a["name"] == "pool"}
        assert run.startswith("driver-")
        runs = json.loads(run_cli(["status", "--json"], up).stdout)["runs"]  # whose they are
        assert runs[run].startswith(f"{run} (pid {first.pid} on ") and str(DRIVER) in runs[run]
        if end in ("done", "error"):
            assert first.stdin is not None
            first.stdin.write("end\n")
            first.stdin.flush()
        else:
            first.send_signal(
                {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigkill": signal.SIGKILL}[end]
            )
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    expected = {"done": 0, "error": 1, "sigterm": 143, "sigint": 130, "sigkill": -signal.SIGKILL}[end]
    assert first.returncode == expected, err[-3000:]
    assert "event stream" not in err, err[-3000:]  # no warning at a normal end
    if end == "sigkill":  # nobody was there to say so: the head stops them once the driver is silent
        deadline = time.monotonic() + 3 * CLIENT_TIMEOUT_S
        while any(a["state"] == "ALIVE" for a in _run_actors(up, run).values()):
            assert time.monotonic() < deadline, _run_actors(up, run)
    actors = _run_actors(up, run)
    assert set(actors) == {"pool", "server-0", "victim"}
    assert actors["victim"]["state"] == "DEAD" and "SIGKILL" in actors["victim"]["reason"]
    for name in ("pool", "server-0"):  # server-0 was spawned by pool, and is the run's all the same
        a = actors[name]
        assert a["state"] == "STOPPED", a
        assert a["reason"].startswith("stopped by "), a
        who = (
            f"the head: its run's client {run} was silent for more than {CLIENT_TIMEOUT_S:g}s (client_timeout)"
            if end == "sigkill"
            else f"{run} (pid {first.pid} on "
        )
        assert who in a["stopped_by"], a
    # The status reads at 80 columns: no line wider, each cell whole.
    table = run_cli(["status"], {**up, "COLUMNS": "80"})
    assert table.returncode == 0, table.stderr
    assert max(len(line) for line in table.stdout.splitlines()) <= 80, table.stdout
    rows = {line.split()[0]: line.split() for line in table.stdout.splitlines() if line.split()}
    assert rows["server-0"][1] == "STOPPED" and rows["victim"][1] == "DEAD", table.stdout
    assert "stopped by" in table.stdout and "SIGKILL" in table.stdout, table.stdout
    # The names are free: the next run on the same cluster starts.
    with _running(_driver(up, "done")) as second:
        _ready(second)
        _leave(second)


def test_a_name_held_by_a_live_run_is_an_error_naming_that_run_and_how_to_end_it(up: dict[str, str]) -> None:
    first = _driver(up, "done")
    try:
        _ready(first)
        second = subprocess.run(
            [sys.executable, str(DRIVER), "spawn"],
            cwd=ROOT,
            env=up,
            capture_output=True,
            text=True,
            timeout=60,
        )
        # Had the first run's actors died (their node silent past node_timeout under load, say),
        # their names would be free and this spawn would succeed: say so, with their states.
        assert second.returncode == 2, (second.stderr[-3000:], _actors(up))
        assert "an actor named 'pool' already exists" in second.stdout
        assert f"(pid {first.pid} on " in second.stdout and f"{DRIVER} done" in second.stdout
        assert f"which is still running; stop that run (kill -TERM {first.pid} on " in second.stdout
    finally:
        first.kill()
        first.wait()


def test_a_driver_whose_loop_is_blocked_past_client_timeout_keeps_its_run(up: dict[str, str]) -> None:
    """Silence is a process gone or stopped, not a busy loop: a driver that blocks its event loop in
    synchronous code for longer than the head's client_timeout still beats (rlactors.wire.beats), so the
    head leaves its run alone and its actors answer afterwards. Meanwhile `rlactors stack` says the
    driver's loop has not run, and blames no actor for the call it last saw the driver wait on
    (victim.nap, answered just before the loop blocked)."""
    with _running(_driver(up, "block")) as driver:
        victim = _ready(driver)
        (run,) = {a["run"] for a in _actors(up) if a["name"] == "pool"}
        assert driver.stdin is not None and driver.stdout is not None
        blocked_s = CLIENT_TIMEOUT_S * 1.5
        driver.stdin.write(f"{blocked_s}\n")
        driver.stdin.flush()
        assert driver.stdout.readline().split() == ["blocking"]
        blocked_at = time.monotonic()
        while True:  # the head sees the loop blocked once its view is two notes (4 s) old
            stack = run_cli(["stack"], up)
            assert stack.returncode == 0, stack.stderr
            if f"{run} (calls as of" in stack.stdout and "its event loop has not run for" in stack.stdout:
                break
            assert time.monotonic() - blocked_at < blocked_s - 2, stack.stdout
        assert time.monotonic() - blocked_at < blocked_s, "the loop ran again before the report was read"
        assert "CULPRIT" not in stack.stdout, stack.stdout
        assert f"{run} waits on victim.nap (not seen there; as the driver saw it" in stack.stdout, (
            stack.stdout
        )
        assert driver.stdout.readline().split() == ["alive", str(victim)]
        actors = _run_actors(up, run)
        assert {n: a["state"] for n, a in actors.items()} == {
            "pool": "ALIVE",
            "server-0": "ALIVE",
            "victim": "ALIVE",
        }
        err = _leave(driver)
    assert "given this client up" not in err and "stopped answering" not in err, err[-3000:]
