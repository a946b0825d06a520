"""The inference pool through the recipe, on reference servers: a killed server is replaced and
serves the current version; a server added mid-run (`rlactors pool add` against a `rlactors up`
cluster) gets requests only once it reports the current version; a removed server's requests
complete elsewhere, drained or not.

A recipe run's start-up is most of its cost, so one run carries the four scenarios one after
the other (:func:`pool_run`), each phase started once the one before has settled; the tests
assert on what it recorded."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster.test_cli import one_node_config
from tests.e2e.live_run import Output, rlactors_stack
from tests.e2e.test_recipe import RECIPE, ROOT, SMALL, rows
from tests.helpers import forked
from tests.helpers.proxy import RecordingProxy

pytestmark = pytest.mark.slow

# A replacement serves the current version within this of its server's death: two missed health
# probes (2 s), a reference server's start-up with the tiny model, and the next publish.
REPLACEMENT_BOUND_S = 60.0
# Each phase's next line comes within this (a phase takes about 10 s here)
PHASE_S = 150.0


def step_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step ")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlactors.launch.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def start_reference_server(model: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "nodes.inference.server",
        "--port",
        str(port),
        "--backend",
        "hf",
        "--model-path",
        str(model),
        "--max-running-requests",
        "16",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # the server loads its model; no readiness signal but /health
    proc.kill()
    raise AssertionError(f"reference server did not start: {log.read_text()[-2000:]}")


def run_logs(err: Path | None) -> str:
    """The tail of a run's stderr ``err`` (``<out_dir>.err``, as the tests here name it) and of its
    servers' logs (``<out_dir>/servers/*.log``): why a run ended, for a failure message."""
    if err is None:
        return ""
    files = [err, *sorted(err.with_suffix("").glob("servers/*.log"))]
    return "\n".join(f"--- {f}:\n{f.read_text(errors='replace')[-2500:]}" for f in files if f.exists())


@contextlib.contextmanager
def up_cluster(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """`rlactors up` of one local node for runs started with ``--cluster``; `rlactors down` after."""
    env = {**os.environ, "RLACTORS_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}
    cfg = one_node_config(tmp_path, cpu=32)
    up = cli(["up", str(cfg)], env)
    assert up.returncode == 0, up.stderr
    try:
        yield cfg, env
    finally:
        down = cli(["down"], env)
    assert down.returncode == 0, down.stderr


def start_run(args: list[str], cfg: Path, env: dict[str, str], err: Path) -> forked.Process:
    """The recipe on the cluster of ``cfg``; its stdout piped, its stderr (the logs) to ``err``."""
    with err.open("w") as stderr:
        return forked.popen(
            [sys.executable, str(RECIPE), *SMALL, *args, "--cluster", str(cfg)],
            preload=forked.DRIVER,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )


def stop(*procs: forked.Process | None) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def server_pid(url: str) -> int:
    """The process of the reference server listening at ``url`` (launched by a node agent, not a
    child of the run's process: found by its ``--port``)."""
    port = url.rsplit(":", 1)[1]
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):  # gone, or no --port
                # split on spaces too: a server forked from its node's fork server names itself with
                # one string (rlactors.node.forkserver)
                argv = (d / "cmdline").read_bytes().replace(b"\0", b" ").split()
                if b"nodes.inference.server" in argv and argv[argv.index(b"--port") + 1] == port.encode():
                    found.append(int(d.name))
    assert len(found) == 1, (url, found)
    return found[0]


def step_of(line: str) -> int:
    m = re.match(r"step (\d+)/", line)
    assert m, line
    return int(m.group(1))


@dataclasses.dataclass
class PoolRun:
    """What :func:`pool_run` saw: the run's output and metrics, and each phase's observations."""

    out: Path
    output: str = ""
    returncode: int | None = None
    joined_after: float | None = None  # seconds from the kill to the replacement's join line
    version: int = 0  # the version the added server joined at
    listed: dict[str, str] = dataclasses.field(default_factory=dict)  # `pool ls`: url -> state
    proxy_url: str = ""
    served: list[str | None] = dataclasses.field(default_factory=list)  # its answers' versions
    before_hold: int = 0  # the last step before its requests were parked
    in_flight: int = 0  # parked requests when `pool rm --no-drain` returned

    @property
    def rows(self) -> list[dict[str, Any]]:
        return rows(self.out)


@pytest.fixture(scope="module")
def pool_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolRun]:
    """One run on a `rlactors up` cluster (two launched servers, one trainer rank, evaluation only
    before the first step and at the end: the evaluator's own client would send the added server
    requests whose failovers the metric does not count), through four phases:

    1. after step 1, SIGKILL of server-0: a replacement is launched and joins; two steps on it;
    2. `rlactors pool add` of a reference server (started beside the run, behind a
       :class:`RecordingProxy`): it joins at the next publish; `pool ls` lists it live;
    3. `rlactors pool rm` (draining) of server-1; two steps after it has left;
    4. the added server's requests parked, `rlactors pool rm --no-drain` of it, then it goes away
       (every request answered 502); three steps after it has left, then SIGTERM.
    """
    from nodes.inference.models import ensure_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("pool")
    run = PoolRun(tmp / "run")
    err = tmp / "run.err"
    proc = joiner = proxy = None

    with up_cluster(tmp) as (cfg, env):
        try:
            args = [
                f"run.out_dir={run.out}",
                "run.steps=400",
                "run.checkpoint_every=400",
                "run.eval_every=0",
                "trainer.n_ranks=1",
            ]
            proc = start_run(args, cfg, env, err)
            out = Output(proc, logs=lambda: run_logs(err), stacks=lambda: rlactors_stack([], env))

            def until(prefix: str) -> str:  # the four phases share one pytest timeout (300 s)
                return out.until(prefix, PHASE_S)

            # the server to add starts while the run does: no steps spent waiting for it later
            joiner, url = start_reference_server(ensure_tiny_checkpoint(), tmp / "joiner.log")
            proxy = RecordingProxy(url)
            run.proxy_url = proxy.url
            until("step 1/")

            # 1. kill a launched server
            ls = cli(["pool", "ls", "--json"], env)
            assert ls.returncode == 0, ls.stderr
            launched = {s["name"]: s["url"] for s in json.loads(ls.stdout)["servers"]}
            assert sorted(launched) == ["server-0", "server-1"], launched
            pids = {name: server_pid(u) for name, u in launched.items()}
            os.kill(pids["server-0"], signal.SIGKILL)
            killed = time.monotonic()
            until("servers joined:")
            run.joined_after = time.monotonic() - killed
            until("step ")
            until("step ")

            # 2. add a server
            add = cli(["pool", "add", proxy.url], env)
            assert add.returncode == 0, add.stderr + out.text()[-2000:] + run_logs(err)
            assert "joining" in add.stdout
            joined = until("servers joined:")
            assert proxy.url in joined, joined
            run.version = int(re.search(r"serving version (\d+)", joined).group(1))
            ls = cli(["pool", "ls", "--json"], env)
            assert ls.returncode == 0, ls.stderr
            run.listed = {s["url"]: s["state"] for s in json.loads(ls.stdout)["servers"]}

            # 3. drain-remove a launched server
            rm = cli(["pool", "rm", launched["server-1"]], env)  # its running requests finish, none start
            assert rm.returncode == 0, rm.stderr
            until("server leaving:")
            until("step ")
            run.before_hold = step_of(until("step "))
            run.served = list(proxy.generated)

            # 4. remove the added server at once, requests in flight
            proxy.hold = True
            deadline = time.monotonic() + 120
            while proxy.held < 1 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)  # until the rollout sends the added server a request
            assert proxy.held >= 1, "the added server got no request to hold"
            rm = cli(["pool", "rm", "--no-drain", proxy.url], env)
            assert rm.returncode == 0, rm.stderr
            run.in_flight = proxy.held  # still parked: rm returned with them in flight
            proxy.gone.set()
            until("server leaving:")
            for _ in range(3):
                until("step ")
            proc.send_signal(signal.SIGTERM)  # it finishes its step and exits 143
            run.output = out.rest(timeout_s=600)
            run.returncode = proc.returncode
            assert run.returncode == 143, run.output[-3000:] + run_logs(err)
        finally:
            stop(proc, joiner)
            if proxy is not None:
                proxy.close()
    yield run


def joins(m: list[dict[str, Any]]) -> list[int]:
    """Indices of the rows whose step saw a server join."""
    return [i for i, r in enumerate(m) if r["servers/joined"]]


def test_a_killed_server_is_replaced_and_serves_the_current_version(pool_run: PoolRun) -> None:
    output = pool_run.output
    assert "launching a replacement" in output, output[-3000:]
    assert pool_run.joined_after is not None and pool_run.joined_after < REPLACEMENT_BOUND_S, output[-3000:]
    m = pool_run.rows
    back, added = joins(m)  # the replacement's step, then the added server's
    assert sum(r["servers/left"] for r in m[: back + 1]) == 1  # the killed one, before it was replaced
    assert all(r["servers/live"] == 2 for r in m[back:added])  # back to two
    assert added - back >= 2  # the replacement served at least two steps before anything else changed
    assert any("servers 2 (+1" in line for line in step_lines(output)), output[-3000:]
    # every live server, the replacement included, holds the step's version at every step
    assert all(r["servers/min_weight_version"] == r["version"] for r in m)


def test_pool_add_through_the_cli_joins_at_the_current_version_and_serves_no_older(pool_run: PoolRun) -> None:
    assert pool_run.version >= 2  # it joined after at least one publish: base weights are not the policy
    assert pool_run.listed[pool_run.proxy_url] == "live"
    # the added server served only the policy it was checked to hold, and later ones: never base weights
    served = pool_run.served
    assert served, "the added server got no requests"
    assert all(v is not None and int(v) >= pool_run.version for v in served), served
    m = pool_run.rows
    assert max(r["servers/live"] for r in m) == 3


def test_pool_rm_drains_a_server_and_the_run_goes_on(pool_run: PoolRun) -> None:
    assert "server leaving:" in pool_run.output
    m = pool_run.rows
    added = joins(m)[1]
    # after the drained server left (before the added one's requests were parked): two servers
    drained = next(i for i in range(added, len(m)) if m[i]["servers/left"])
    assert drained < pool_run.before_hold
    assert all(r["servers/live"] == 2 for r in m[drained : pool_run.before_hold])


def test_pool_rm_no_drain_moves_the_removed_servers_requests_in_flight_elsewhere(pool_run: PoolRun) -> None:
    """`rlactors pool rm --no-drain` returns while the server still holds requests; the server
    then goes away (as a user removing it at once would take it down), and the requests it held
    complete on the other server (that every group is still trained once, the test below checks)."""
    assert pool_run.in_flight >= 1
    m = pool_run.rows
    # every request the removed server held was sent again to another server and finished there
    before = m[pool_run.before_hold - 1]["rollout/failovers"]
    assert m[-1]["rollout/failovers"] - before >= pool_run.in_flight, (
        pool_run.in_flight,
        pool_run.before_hold,
        [r["rollout/failovers"] for r in m],
    )
    assert m[-1]["servers/live"] == 1  # the replacement: the one server neither killed nor removed


def test_every_group_is_trained_once_through_kill_add_and_removals(pool_run: PoolRun) -> None:
    assert pool_run.returncode == 143  # ended by the SIGTERM, cleanly
    m = pool_run.rows
    n = len(m)
    assert [r["step"] for r in m] == list(range(1, n + 1))
    # joined: the replacement, the added server; left: the killed, the drained, the removed
    assert sum(r["servers/joined"] for r in m) == 2 and sum(r["servers/left"] for r in m) == 3
    assert all(r["train/n_seqs"] == 4 for r in m)
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == 2 * n and len(set(groups)) == 2 * n  # no group lost or trained twice
