"""The inference pool through the recipe, on reference servers: a killed server is replaced and
serves the current version; a server added mid-run (`rlactors pool add` against a `rlactors up`
cluster) gets requests only once it reports the current version; a removed server's requests
complete elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster.test_cli import one_node_config
from tests.e2e.test_recipe import RECIPE, ROOT, SMALL, _cmdline, _descendants, rows, start_until_first_step

# A replacement serves the current version within this of its server's death: two missed health
# probes (2 s), a reference server's start-up with the tiny model, and the next publish.
REPLACEMENT_BOUND_S = 60.0


def step_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step ")]


@pytest.mark.slow
def test_a_killed_server_is_replaced_and_serves_the_current_version(tmp_path: Path) -> None:
    # The run is long enough for a slow machine's replacement to start (steps here take 1-2 s and
    # a start-up 10-40 s); once the replacement has served two steps, SIGTERM ends it cleanly.
    out = tmp_path / "run"
    proc, lines = start_until_first_step(
        [*SMALL, f"run.out_dir={out}", "run.checkpoint_every=100"], 100, subprocess.DEVNULL
    )
    try:
        servers = [p for p in _descendants(proc.pid) if "nodes.inference.server" in _cmdline(p)]
        assert len(servers) == 2, "".join(lines)
        os.kill(servers[0], signal.SIGKILL)
        killed = time.monotonic()
        assert proc.stdout is not None
        joined_after = None
        steps_after_join = 0
        rest = []
        for line in proc.stdout:
            rest.append(line)
            if joined_after is None and line.startswith("servers joined:"):
                joined_after = time.monotonic() - killed
            elif joined_after is not None and line.startswith("step "):
                steps_after_join += 1
                if steps_after_join == 2:
                    proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines + rest)
    assert "launching a replacement" in output, output[-3000:]
    assert joined_after is not None and joined_after < REPLACEMENT_BOUND_S, output[-3000:]
    assert proc.returncode == 143, output[-3000:]  # ended by the SIGTERM, cleanly
    m = rows(out)
    n = len(m)
    assert [r["step"] for r in m] == list(range(1, n + 1))
    assert sum(r["servers/joined"] for r in m) == 1 and sum(r["servers/left"] for r in m) == 1
    assert m[-1]["servers/live"] == 2  # back to two
    back = next(i for i, r in enumerate(m) if r["servers/joined"])
    assert all(r["servers/live"] == 2 for r in m[back:])
    assert n - back >= 2  # the replacement served at least two steps
    # every live server, the replacement included, holds the step's version at every step
    assert all(r["servers/min_weight_version"] == r["version"] for r in m)
    assert any("servers 2 (+1" in line for line in step_lines(output)), output[-3000:]
    assert all(r["train/n_seqs"] == 4 for r in m)
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == 2 * n and len(set(groups)) == 2 * n  # no group lost or trained twice


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlactors.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


class RecordingProxy:
    """An HTTP proxy in front of a server that records the ``weight_version`` of every
    ``/generate`` answer it passes on: what the server served, and when.

    With ``hold`` set, ``/generate`` requests are parked before they reach the server (in flight,
    as their client sees it; ``held`` counts them); once ``gone`` is set, every request, a parked one
    included, is answered 502, as a proxy answers for a server that went away."""

    def __init__(self, target: str) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        self.generated: list[str | None] = []
        self.hold = False
        self.gone = threading.Event()
        self.held = 0
        self.port = free_port()
        client = httpx.AsyncClient(base_url=target, timeout=None)  # group joins block for long

        async def forward(request: Request) -> Response:
            if request.url.path == "/generate" and self.hold:
                self.held += 1
                await asyncio.to_thread(self.gone.wait)  # set from the test's thread
            if self.gone.is_set():
                return Response(b"server gone", 502)
            r = await client.request(
                request.method, request.url.path, content=await request.body(),
                headers={"content-type": request.headers.get("content-type", "application/json")},
            )  # fmt: skip
            if request.url.path == "/generate" and r.status_code == 200:
                self.generated.append(r.json()["meta_info"].get("weight_version"))
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

        app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "PUT"])])
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)  # uvicorn offers no start event to wait on
        assert self.server.started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_reference_server(model: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "nodes.inference.server", "--port", str(port), "--backend", "hf",
           "--model-path", str(model), "--max-running-requests", "16"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
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


def read_until(proc: subprocess.Popen[str], lines: list[str], prefix: str, err: Path | None = None) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the run ended before {prefix!r}: {''.join(lines)[-3000:]}\n{run_logs(err)}")


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


def start_run(args: list[str], cfg: Path, env: dict[str, str], err: Path) -> subprocess.Popen[str]:
    """The recipe on the cluster of ``cfg``; its stdout piped, its stderr (the logs) to ``err``."""
    return subprocess.Popen(
        [sys.executable, str(RECIPE), *SMALL, *args, "--cluster", str(cfg)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=err.open("w"), text=True, env=env,
    )  # fmt: skip


def stop(*procs: subprocess.Popen[Any] | None) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


@dataclasses.dataclass
class JoinedRun:
    proc: subprocess.Popen[str]
    lines: list[str]  # what the run printed so far
    err: Path  # the run's stderr
    env: dict[str, str]  # for `rlactors` commands against its cluster
    proxy: RecordingProxy  # in front of the server that joined
    version: int  # the version it joined at

    def read_until(self, prefix: str) -> str:
        return read_until(self.proc, self.lines, prefix, self.err)

    def end_after(self, steps: int) -> str:
        """Let the run train ``steps`` more steps, then end it with SIGTERM (it finishes its step
        and exits 143); everything it printed."""
        for _ in range(steps):
            self.read_until("step ")
        self.proc.send_signal(signal.SIGTERM)
        rest, _ = self.proc.communicate(timeout=600)
        output = "".join(self.lines) + rest
        assert self.proc.returncode == 143, output[-3000:] + run_logs(self.err)
        return output


@contextlib.contextmanager
def run_and_join_a_server(tmp_path: Path, *args: str) -> Iterator[JoinedRun]:
    """A run on a `rlactors up` cluster (``args``: more overrides); after step 1 a reference server
    started by hand, behind a :class:`RecordingProxy`, is added with `rlactors pool add` and joins
    at the next publish. The run is long (100 steps; a test ends it with :meth:`JoinedRun.end_after`)
    so that the server's start-up on a slow machine cannot outlast it. The run, the server and the
    proxy are stopped on the way out."""
    from nodes.inference.models import ensure_tiny_checkpoint

    out, err = tmp_path / "run", tmp_path / "run.err"
    proc = joiner = proxy = None
    lines: list[str] = []
    with up_cluster(tmp_path) as (cfg, env):
        try:
            run_args = [f"run.out_dir={out}", "run.steps=100", "run.checkpoint_every=100", *args]
            proc = start_run(run_args, cfg, env, err)
            read_until(proc, lines, "step 1/", err)
            joiner, url = start_reference_server(ensure_tiny_checkpoint(), tmp_path / "joiner.log")
            proxy = RecordingProxy(url)
            add = cli(["pool", "add", proxy.url], env)
            assert add.returncode == 0, add.stderr + "".join(lines)[-2000:] + run_logs(err)
            assert "joining" in add.stdout
            joined = read_until(proc, lines, "servers joined:", err)
            assert proxy.url in joined
            version = int(re.search(r"serving version (\d+)", joined).group(1))
            yield JoinedRun(proc, lines, err, env, proxy, version)
        finally:
            stop(proc, joiner)
            if proxy is not None:
                proxy.close()


@pytest.mark.slow
def test_pool_add_and_rm_through_the_cli_during_a_run_on_an_up_cluster(tmp_path: Path) -> None:
    with run_and_join_a_server(tmp_path) as run:
        assert run.version >= 2  # it joined after at least one publish: base weights are not the policy
        ls = cli(["pool", "ls", "--json"], run.env)
        assert ls.returncode == 0, ls.stderr
        servers: list[dict[str, Any]] = json.loads(ls.stdout)["servers"]
        assert {s["url"]: s["state"] for s in servers}[run.proxy.url] == "live"
        leaving = next(s["url"] for s in servers if s["name"] == "server-0")
        rm = cli(["pool", "rm", leaving], run.env)  # drains: its running requests finish, none start
        assert rm.returncode == 0, rm.stderr
        run.read_until("server leaving:")
        run.end_after(2)
    proxy, version, out = run.proxy, run.version, tmp_path / "run"
    # the joiner served only the policy it was checked to hold, and later ones: never base weights
    assert proxy.generated, "the joined server got no requests"
    assert all(v is not None and int(v) >= version for v in proxy.generated), proxy.generated
    m = rows(out)
    n = len(m)
    assert [r["step"] for r in m] == list(range(1, n + 1))
    assert sum(r["servers/joined"] for r in m) == 1 and sum(r["servers/left"] for r in m) == 1
    assert m[-1]["servers/live"] == 2
    assert max(r["servers/live"] for r in m) == 3
    assert all(r["servers/min_weight_version"] == r["version"] for r in m)
    assert all(r["train/n_seqs"] == 4 for r in m)
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == 2 * n and len(set(groups)) == 2 * n  # nothing lost or trained twice


@pytest.mark.slow
def test_pool_rm_no_drain_moves_the_removed_servers_requests_in_flight_elsewhere(tmp_path: Path) -> None:
    """`rlactors pool rm --no-drain` returns while the server still holds requests; the server
    then goes away (as a user removing it at once would take it down), and the requests it held
    complete on the other servers: every group is trained once."""
    # evaluation only before the first step: the evaluator's own client (not a rollout actor's,
    # whose failovers the metric counts) would send the joiner requests too
    with run_and_join_a_server(tmp_path, "run.eval_every=0") as run:
        run.proxy.hold = True
        deadline = time.monotonic() + 120
        while run.proxy.held < 1 and time.monotonic() < deadline and run.proc.poll() is None:
            time.sleep(0.05)  # until the rollout sends the joined server a request
        assert run.proxy.held >= 1, "the joined server got no request to hold"
        rm = cli(["pool", "rm", "--no-drain", run.proxy.url], run.env)
        assert rm.returncode == 0, rm.stderr
        in_flight = run.proxy.held  # still parked: rm returned with them in flight
        run.proxy.gone.set()
        run.read_until("server leaving:")
        run.end_after(3)
    m = rows(tmp_path / "run")
    n = len(m)
    assert [r["step"] for r in m] == list(range(1, n + 1))
    assert sum(r["servers/joined"] for r in m) == 1 and sum(r["servers/left"] for r in m) == 1
    assert m[-1]["servers/live"] == 2
    # every request the removed server held was sent again to another server and finished there
    assert m[-1]["rollout/failovers"] >= in_flight, (in_flight, [r["rollout/failovers"] for r in m])
    assert all(r["train/n_seqs"] == 4 for r in m)
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == 2 * n and len(set(groups)) == 2 * n  # nothing lost or trained twice
