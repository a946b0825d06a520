"""The stall watchdog, on stalls injected into real runs: a workflow that never returns, and a
server that accepts requests and never answers. Each names the right actor or server, writes its
report and kills nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_recipe import RECIPE, ROOT, SMALL, _cmdline, _descendants

STALL = ["run.stall_after_s=12", "run.batch_timeout_s=600", "run.steps=20", "run.eval_every=0"]


def run_until(
    args: list[str], marker: str, timeout_s: float = 400
) -> tuple[subprocess.Popen[str], list[str]]:
    """Start the recipe and read its output until a line holds ``marker``."""
    proc = subprocess.Popen(
        [sys.executable, str(RECIPE), *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            return proc, lines
    stop(proc)
    raise AssertionError(f"no line with {marker!r}:\n" + "".join(lines[-40:]))


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
def test_a_workflow_that_never_returns_is_named(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [*SMALL, *STALL, "rollout.workflow=tests.e2e.stall_workflow:NeverReturns", f"run.out_dir={out}"]
    proc, lines = run_until(args, "stall: step 1")
    try:
        line = lines[-1]
        assert "waiting on rollout-0 (its episode gsm8k/e" in line and "has been in flight" in line
        report = (out / "stalls" / "step-1.txt").read_text()
        assert "waiting on: rollout-0" in report and '"oldest_in_flight"' in report and '"servers"' in report
        # the line ends with the command that reaches this embedded run, and it does
        command = line.rstrip().split("; stacks now: ", 1)[1]
        assert command.startswith("rlactors stack --run ") and Path(command.split()[-1]) == out
        stack = subprocess.run(
            [sys.executable, "-m", "rlactors.cli", *command.split()[1:], "rollout-0"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert stack.returncode == 0 and stack.stdout.startswith("stacks of 1 actor"), stack.stderr
        assert proc.poll() is None  # it kills nothing and keeps watching
    finally:
        stop(proc)


@pytest.mark.slow
def test_a_server_that_never_answers_is_named(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [*SMALL, *STALL, "servers.n=1", f"run.out_dir={out}"]
    proc, _ = run_until(args, "step 1/20")
    (server,) = [p for p in _descendants(proc.pid) if "nodes.inference.server" in _cmdline(p)]
    cmd = _cmdline(server).split()
    url = f"http://{cmd[cmd.index('--host') + 1]}:{cmd[cmd.index('--port') + 1]}"
    os.kill(server, signal.SIGSTOP)  # its socket still accepts; nothing answers
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("stall: "):
                break
        assert f"waiting on server {url} (it does not answer" in line
        step = int(line.split()[2].rstrip(","))
        assert f"server {url}" in (out / "stalls" / f"step-{step}.txt").read_text()
    finally:
        os.kill(server, signal.SIGCONT)
        stop(proc)
