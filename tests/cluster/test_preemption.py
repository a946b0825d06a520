"""A scheduler's SIGTERM to every process of a job (Slurm at `scancel` or the time limit) reaches an
`rlactors up` cluster's head, agents and workers as well as the run's driver: the daemons leave it to
the driver, serve its run until it has left, and then stop (issue 39, item 5). The recipe under such
a SIGTERM is tested in tests/e2e/test_preemption.py."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from tests.cluster.test_run_end import _actors, _driver, _ready, up  # noqa: F401 (the fixture)
from tests.helpers.processes import descendants, gone


def test_sigterm_to_every_process_of_the_job_is_left_to_the_driver_then_the_cluster_stops(
    up: dict[str, str],  # noqa: F811
) -> None:
    state = json.loads((Path(up["RLACTORS_STATE_DIR"]) / "cluster.json").read_text())
    head, agents = state["head_pid"], [a["pid"] for a in state["agents"].values()]
    driver = _driver(up, "done")
    try:
        _ready(driver)
        victim_pids = {a["name"]: a["pid"] for a in _actors(up)}
        workers = [p for a in agents for p in descendants(a)]
        assert set(victim_pids.values()) <= set(workers)
        for pid in (head, *agents, *workers):  # what Slurm does: every process of the job
            os.kill(pid, signal.SIGTERM)
        # The run goes on: the head answers, every actor of the run is alive in its process.
        actors = {a["name"]: a for a in _actors(up)}
        assert {n: a["state"] for n, a in actors.items()} == {
            "pool": "ALIVE",
            "server-0": "ALIVE",
            "victim": "ALIVE",
        }
        assert {n: a["pid"] for n, a in actors.items()} == victim_pids
        assert all(not gone(p, 0) for p in (head, *agents, *workers))
        # The driver ends its run and leaves: then the head stops, and the agents after it.
        assert driver.stdin is not None
        driver.stdin.write("end\n")
        driver.stdin.flush()
        _, err = driver.communicate(timeout=60)
        assert driver.returncode == 0, err[-3000:]
        for pid in (head, *agents, *workers):
            assert gone(pid, 60), f"{pid} still running"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
