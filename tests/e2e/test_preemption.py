"""Preemption as schedulers deliver it (issue 39, item 5): Slurm, ``timeout`` and systemd send
SIGTERM to every process of the job at once, not to the driver alone. Either way the recipe
finishes its step, checkpoints it, exits 143, and ``--resume`` continues from that checkpoint.

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
def test_sigterm_to_the_whole_process_group_checkpoints_and_resumes(tmp_path: Path) -> None:
    """As the SIGTERM to the driver alone (tests/e2e/test_recipe.py) does."""
    out = tmp_path / "run"
    args = [*SMALL, f"run.out_dir={out}", "run.checkpoint_every=50"]  # no checkpoint but the one at the stop
    proc = _start(args, {**os.environ, "PYTHONPATH": str(ROOT)}, tmp_path / "err")
    _terminate_after_step_1(proc, out, alone=False)
    _check_stopped_and_resume(proc, out, tmp_path / "err", args)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["driver group", "every process"])
def test_sigterm_on_an_rlactors_up_cluster_checkpoints_and_resumes(tmp_path: Path, to: str) -> None:
    out = tmp_path / "run"
    with up_cluster(tmp_path) as (cfg, env):
        args = [*SMALL, f"run.out_dir={out}", "run.checkpoint_every=50"]
        proc = _start([*args, "--cluster", str(cfg)], env, tmp_path / "err")
        state = json.loads((tmp_path / "state" / "cluster.json").read_text())
        daemons = [state["head_pid"], *(a["pid"] for a in state["agents"].values())]
        # Slurm signals every process of the job; a terminal or `timeout`, the driver's group.
        _terminate_after_step_1(proc, out, alone=False, daemons=daemons if to == "every process" else [])
        again_on = ["--cluster", str(cfg)] if to == "driver group" else []  # the same cluster: names free
        _check_stopped_and_resume(proc, out, tmp_path / "err", args, again_on)
        if to == "every process":  # the daemons stopped after the run (the agents once the head had)
            for pid in daemons:
                assert _wait_gone(pid, 60), f"daemon {pid} still running"


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
) -> None:
    """Once step 1 is in metrics.jsonl: SIGTERM to the driver ``alone``, or to its process group
    and to every process of these ``daemons`` (their groups, and each descendant); wait for its exit."""
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
            # The cluster's own processes; an inference server started by an actor is not one of
            # them (nodes.inference owns how a server takes a scheduler's signal).
            descendants = [p for d in daemons for p in _descendants(d) if "rlactors.worker" in _cmdline(p)]
            for group in (proc.pid, *daemons):
                os.killpg(group, signal.SIGTERM)
            for pid in descendants:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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
