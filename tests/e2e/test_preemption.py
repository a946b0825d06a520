"""Preemption as schedulers deliver it (issue 39, item 5): Slurm, ``timeout`` and systemd send
SIGTERM to every process of the job at once, not to the driver alone. Either way the recipe
finishes its step, checkpoints it, exits 143, and ``--resume`` continues from that checkpoint.

Slurm signals each process of a step (its cgroup), the run's inference servers too: a server holds
the SIGTERM back (it stays pending) and serves until its owner stops it, and none outlives the run.

On an `rlactors up` cluster the daemons run in sessions of their own: a SIGTERM to the driver's
process group reaches the driver alone. Under Slurm the cluster is the job's too, and every process
of it (head, agents, workers) gets the SIGTERM: the daemons leave it to the run's driver and stop
after it (the head once no run is connected, the agents once their head is gone)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.e2e.test_pool import up_cluster
from tests.e2e.test_recipe import RECIPE, ROOT, SMALL, _cmdline, _descendants, recipe, rows


@pytest.mark.slow
@pytest.mark.timeout(900)  # a run and its resume; minutes on a loaded 2-core machine
def test_sigterm_to_the_whole_process_group_checkpoints_and_resumes(tmp_path: Path) -> None:
    """As the SIGTERM to the driver alone (tests/e2e/test_recipe.py) does; sent as Slurm sends it,
    to the process group and to each process of the job, the inference servers included."""
    out = tmp_path / "run"
    args = [*SMALL, f"run.out_dir={out}", "run.checkpoint_every=50"]  # no checkpoint but the one at the stop
    proc = _start(args, {**os.environ, "PYTHONPATH": str(ROOT)}, tmp_path / "err")
    servers = _terminate_after_step_1(proc, out, alone=False, daemons=[proc.pid])
    assert servers, "the run started no inference server"
    for pid in servers:  # stopped by their owner at the run's end: none outlives it
        assert _wait_gone(pid, 60), f"server process {pid} outlived the run"
    _check_stopped_and_resume(proc, out, tmp_path / "err", args)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("to", ["driver group", "every process"])
def test_sigterm_on_an_rlactors_up_cluster_checkpoints_and_resumes(tmp_path: Path, to: str) -> None:
    out = tmp_path / "run"
    with up_cluster(tmp_path) as (cfg, env):
        args = [*SMALL, f"run.out_dir={out}", "run.checkpoint_every=50"]
        proc = _start([*args, "--cluster", str(cfg)], env, tmp_path / "err")
        state = json.loads((tmp_path / "state" / "cluster.json").read_text())
        daemons = [state["head_pid"], *(a["pid"] for a in state["agents"].values())]
        # Slurm signals every process of the job; a terminal or `timeout`, the driver's group.
        servers = _terminate_after_step_1(
            proc, out, alone=False, daemons=daemons if to == "every process" else []
        )
        again_on = ["--cluster", str(cfg)] if to == "driver group" else []  # the same cluster: names free
        if to == "every process":  # the daemons stopped after the run (the agents once the head had)
            assert servers, "the run started no inference server"
            for pid in [*daemons, *servers]:
                assert _wait_gone(pid, 60), f"{pid} still running"
        _check_stopped_and_resume(proc, out, tmp_path / "err", args, again_on)


def _start(args: list[str], env: dict[str, str], err: Path) -> subprocess.Popen[str]:
    with err.open("w") as stderr:
        return subprocess.Popen(
            [sys.executable, str(RECIPE), "run.steps=50", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            start_new_session=True,  # the job's own process group, as under a scheduler
        )


def _terminate_after_step_1(
    proc: subprocess.Popen[str], out: Path, alone: bool, daemons: Sequence[int] = ()
) -> list[int]:
    """Once step 1 is in metrics.jsonl: SIGTERM to the driver ``alone``, or to its process group
    and to every process of these ``daemons`` (their groups, and each descendant: the inference
    servers' processes too, as Slurm signals every process of a step); wait for the driver's exit.
    Returns the servers' processes that were signalled, each checked to hold the SIGTERM pending
    (alive, serving until its owner stops it)."""
    servers: list[int] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and (line := proc.stdout.readline()):
            if line.startswith("step 1/"):  # metrics.jsonl has step 1's line
                break
        assert rows(out), "the run never finished step 1"
        if alone:
            proc.send_signal(signal.SIGTERM)
        else:
            descendants = [p for d in daemons for p in _descendants(d)]
            servers = _server_processes(descendants)
            for group in (proc.pid, *daemons):
                os.killpg(group, signal.SIGTERM)
            for pid in descendants:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            # kill() queues a blocked signal before it returns; the driver stops the servers only
            # after its step and checkpoint, so each is still there holding it.
            for pid in servers:
                assert _holds_sigterm(pid), f"server process {pid} ({_cmdline(pid)}) acted on the SIGTERM"
        proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return servers


def _server_processes(pids: Sequence[int]) -> list[int]:
    """The inference servers' processes among ``pids``, and the processes they started."""
    roots = [p for p in pids if "nodes.inference.server" in _cmdline(p) or "sglang" in _cmdline(p)]
    return sorted({*roots, *(c for r in roots for c in _descendants(r))})


def _holds_sigterm(pid: int) -> bool:
    """Whether ``pid`` lives with a SIGTERM pending and blocked: held, never acted on (a SIGTERM
    pending but not blocked is one the process is about to act on)."""
    status = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
    )
    bit = 1 << (signal.SIGTERM - 1)
    pending = (int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)) & bit
    return bool(pending and int(status["SigBlk"], 16) & bit)


def _check_stopped_and_resume(
    proc: subprocess.Popen[str], out: Path, err_file: Path, args: list[str], again_on: Sequence[str] = ()
) -> None:
    """The run exited 143 with its last step's checkpoint on disk, and ``--resume`` (on the cluster
    ``again_on`` names, else an embedded one) continues from it."""
    err = err_file.read_text()
    assert proc.returncode == 143, err[-3000:]
    assert "terminated: shut down cleanly" in err and "died" not in err, err[-3000:]
    assert "event stream" not in err, err[-3000:]  # leaving the cluster is no lost connection
    done = rows(out)[-1]["step"]
    assert done >= 1
    assert (out / "checkpoints" / "latest").read_text().strip() == str(done)
    assert (out / "checkpoints" / f"step-{done}").is_dir()
    again = recipe([*args, f"run.steps={done + 1}", "--resume", *again_on])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {done} (policy version {done};" in again.stdout
    assert [r["step"] for r in rows(out)] == list(range(1, done + 2))


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.2)  # polling a pid: there is no event for another process's exit
    return False
