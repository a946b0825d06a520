"""Nothing left behind (issue 39, items 2 and 4): a recipe run on an `rlactors up` cluster that
stops with an error (a trainer rank killed) leaves no actor running; `status` shows the actors its
driver stopped as STOPPED, with who stopped them, and the killed rank as DEAD; the next run on the
same cluster starts, runs and ends without a warning."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.cluster.test_cli import run_cli
from tests.e2e.live_run import LiveRun
from tests.e2e.test_pool import up_cluster
from tests.e2e.test_recipe import SMALL, recipe

# Two trainer ranks (one is killed, and its name is taken again by the next run), one server.
ONE_SERVER = [*SMALL, "servers.n=1"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # two runs and a cluster: minutes on a loaded 2-core machine
def test_a_run_stopped_by_a_dead_rank_leaves_nothing_behind_and_the_next_run_starts(tmp_path: Path) -> None:
    with up_cluster(tmp_path) as (cfg, env):
        first = tmp_path / "first"
        args = ["run.steps=50", *ONE_SERVER, f"run.out_dir={first}", "--cluster", str(cfg)]
        with LiveRun(args, tmp_path / "first.err", env=env) as proc:
            proc.until("step 1/")
            actors = {a["name"]: a for a in _status(env)["actors"]}
            run = actors["trainer-1"]["run"]
            os.kill(actors["trainer-1"]["pid"], signal.SIGKILL)
            returncode = proc.finish(timeout_s=300)
        err = proc.stderr()
        assert returncode == 1 and "error: actor trainer-1" in err, err[-3000:]
        ended = {a["name"]: a for a in _status(env)["actors"] if a["run"] == run}
        assert {"trainer-0", "trainer-1", "server-0", "governor", "buffer"} <= set(ended)
        assert not [a for a in ended.values() if a["state"] not in ("STOPPED", "DEAD")], ended
        assert ended["trainer-1"]["state"] == "DEAD" and "SIGKILL" in ended["trainer-1"]["reason"]
        for name in ("trainer-0", "server-0", "governor", "buffer"):  # the server: the pool's
            assert ended[name]["state"] == "STOPPED", ended[name]
            assert ended[name]["reason"].startswith(f"stopped by {run} (pid {proc.pid} on "), ended[name]
        # The same names, on the same cluster: the next run starts, and ends without a warning.
        second = recipe(
            ["run.steps=1", *ONE_SERVER, f"run.out_dir={tmp_path / 'second'}", "--cluster", str(cfg)]
        )
        assert second.returncode == 0, second.stderr[-3000:]
        # (a driver stalled past client_timeout on a loaded machine is reported, and is not this test's:
        # it asserts that a normal end, and a start after a failed run, print no warning)
        warnings = [w for w in second.stderr.splitlines() if "warning" in w and "client_timeout" not in w]
        assert not warnings, second.stderr[-3000:]
        assert not [a for a in _status(env)["actors"] if a["state"] == "ALIVE"]


def _status(env: dict[str, str]) -> dict:
    res = run_cli(["status", "--json"], env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)
