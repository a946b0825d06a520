"""The stall watchdog, on stalls injected into a real run: a server that accepts requests and never
answers, then a workflow that never returns. Each names the right server or actor, writes its
report and kills nothing.

One run carries both (a run costs a minute of CPU, mostly start-up): after step 1 its one server is
stopped (SIGSTOP) until the watchdog names it; then the workflow is armed (episodes started from then
on never return) and the server continued, and the run stalls again once the episodes finished before
are trained, on the rollout actor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.live_run import LiveRun
from tests.e2e.stall_workflow import ARMED
from tests.e2e.test_recipe import ROOT, SMALL
from tests.helpers.processes import cmdline

# One server and one trainer rank: the stalls are a workflow's and a server's.
STALL = [
    "run.stall_after_s=12",
    "run.batch_timeout_s=600",
    "run.steps=20",
    "run.eval_every=0",
    "servers.n=1",
    "trainer.n_ranks=1",
    "rollout.workflow=tests.e2e.stall_workflow:NeverReturnsOnceArmed",
]


@dataclass
class Stalls:
    out: Path
    url: str  # the server's
    server_line: str  # the watchdog's line while the server was stopped
    workflow_line: str  # its line while an episode never returned
    stack: subprocess.CompletedProcess[str]  # the command the workflow's line ends with, run
    alive: bool  # the run still running after both


def stall_step(line: str) -> int:
    return int(line.split()[2].rstrip(","))


@pytest.fixture(scope="module")
def stalls(tmp_path_factory: pytest.TempPathFactory) -> Stalls:
    tmp = tmp_path_factory.mktemp("stall")
    out, armed = tmp / "run", tmp / "armed"
    env = {**os.environ, "PYTHONPATH": str(ROOT), ARMED: str(armed)}
    with LiveRun([*SMALL, *STALL, f"run.out_dir={out}"], tmp / "err", env=env) as run:
        run.until("step 1/20")
        (server,) = run.processes("nodes.inference.server")
        cmd = cmdline(server).split()
        url = f"http://{cmd[cmd.index('--host') + 1]}:{cmd[cmd.index('--port') + 1]}"
        os.kill(server, signal.SIGSTOP)  # its socket still accepts; nothing answers
        try:
            server_line = run.until("stall: ")
            armed.touch()
        finally:
            os.kill(server, signal.SIGCONT)
        # the server's step may be reported again before it finishes; the next step's stall is the workflow's
        workflow_line = run.until("stall: ")
        while stall_step(workflow_line) == stall_step(server_line):
            workflow_line = run.until("stall: ")
        command = workflow_line.rstrip().split("; stacks now: ", 1)[1]
        assert command.startswith("rlactors stack --run ") and Path(command.split()[-1]) == out, workflow_line
        stack = subprocess.run(
            [sys.executable, "-m", "rlactors.launch.cli", *command.split()[1:], "rollout-0"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        alive = run.proc.poll() is None  # it kills nothing and keeps watching
        run.proc.send_signal(signal.SIGTERM)
        run.finish(timeout_s=150)
    return Stalls(out, url, server_line, workflow_line, stack, alive)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_server_that_never_answers_is_named(stalls: Stalls) -> None:
    line = stalls.server_line
    assert f"waiting on server {stalls.url} (it does not answer" in line
    assert f"server {stalls.url}" in (stalls.out / "stalls" / f"step-{stall_step(line)}.txt").read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_workflow_that_never_returns_is_named(stalls: Stalls) -> None:
    line = stalls.workflow_line
    assert "waiting on rollout-0 (its episode gsm8k/e" in line and "has been in flight" in line
    report = (stalls.out / "stalls" / f"step-{stall_step(line)}.txt").read_text()
    assert "waiting on: rollout-0" in report and '"oldest_in_flight"' in report and '"servers"' in report
    # the line ends with the command that reaches this embedded run, and it does
    assert stalls.stack.returncode == 0 and stalls.stack.stdout.startswith("stacks of 1 actor"), (
        stalls.stack.stderr
    )
    assert stalls.alive
