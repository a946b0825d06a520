"""Preemption as schedulers deliver it (issue 39, item 5): Slurm, ``timeout`` and systemd send
SIGTERM to every process of the job at once, not to the driver alone. Either way the recipe
finishes its step, checkpoints it, exits 143, and ``--resume`` continues from that checkpoint.

Slurm signals each process of a step (its cgroup), the run's inference servers too: a server holds
the SIGTERM back (it stays pending) and serves until its owner stops it, and none outlives the run.

On an `rlactors up` cluster the daemons run in sessions of their own: a SIGTERM to the driver's
process group reaches the driver alone. Under Slurm the cluster is the job's too, and every process
of it (head, agents, workers) gets the SIGTERM: the daemons leave it to the run's driver and stop
after it (the head once no run is connected, the agents once their head is gone).

One run folder carries the three deliveries, each stop resumed by the next run (a run costs a
minute of CPU, mostly start-up): see :class:`Chain`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.live_run import LiveRun
from tests.e2e.test_pool import up_cluster
from tests.e2e.test_recipe import ROOT, SMALL, recipe, rows
from tests.helpers.processes import cmdline, descendants

# One inference server does (the servers' part is to hold the SIGTERM); two trainer ranks, each
# signalled, save the checkpoint at the stop together. No checkpoint but the one at each stop.
ARGS = [*SMALL, "servers.n=1", "run.checkpoint_every=50"]


@dataclass
class Stop:
    """A run stopped by SIGTERM after its first step, and what it left when it exited."""

    returncode: int
    stdout: str
    err: str
    done: int  # the last step in metrics.jsonl
    latest: str  # checkpoints/latest
    saved: bool  # checkpoints/step-<done> is there
    servers: list[int]  # the inference servers' processes that were signalled
    outlived: list[int]  # those, and any daemons signalled, still running a minute after the run


@dataclass
class Chain:
    """One run folder, stopped and resumed three times: SIGTERM to the driver's process group on
    an `rlactors up` cluster; resumed on the same cluster, SIGTERM to every process of the job
    (the cluster's daemons too); resumed embedded, SIGTERM to its process group and to each of its
    processes; resumed again to one more step."""

    out: Path
    group: Stop
    every: Stop
    embedded: Stop
    last: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    tmp = tmp_path_factory.mktemp("preemption")
    out = tmp / "run"
    with up_cluster(tmp) as (cfg, env):
        state = json.loads((tmp / "state" / "cluster.json").read_text())
        daemons = [state["head_pid"], *(a["pid"] for a in state["agents"].values())]
        on_cluster = ["run.steps=50", f"run.out_dir={out}", "--cluster", str(cfg)]
        # a terminal or `timeout`: the driver's group; the same cluster's names are then free
        group = _stop_after_a_step([*ARGS, *on_cluster], env, tmp / "group.err", daemons=[])
        # Slurm: every process of the job, the cluster's too
        every = _stop_after_a_step([*ARGS, *on_cluster, "--resume"], env, tmp / "every.err", daemons)
    embedded_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [*ARGS, f"run.out_dir={out}"]
    embedded = _stop_after_a_step(
        [*args, "run.steps=50", "--resume"], embedded_env, tmp / "embedded.err", daemons=None
    )
    last = recipe([*args, f"run.steps={embedded.done + 1}", "--resume"])
    return Chain(out, group, every, embedded, last)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the whole chain runs here: four runs, minutes each on a loaded 2-core machine
def test_sigterm_to_the_driver_group_on_an_rlactors_up_cluster_checkpoints_and_resumes(chain: Chain) -> None:
    _check_stopped(chain.group)
    _check_resumed(chain.group, chain.every.stdout)  # on the same cluster


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_to_every_process_of_an_rlactors_up_cluster_checkpoints_and_resumes(chain: Chain) -> None:
    """The daemons stopped after the run (the agents once the head had), the servers with it."""
    _check_stopped(chain.every)
    assert chain.every.servers, "the run started no inference server"
    assert not chain.every.outlived, f"{chain.every.outlived} still running"
    _check_resumed(chain.every, chain.embedded.stdout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_to_the_whole_process_group_checkpoints_and_resumes(chain: Chain) -> None:
    """As the SIGTERM to the driver alone (tests/e2e/test_recipe.py) does; sent as Slurm sends it,
    to the process group and to each process of the job, the inference servers included."""
    _check_stopped(chain.embedded)
    assert chain.embedded.servers, "the run started no inference server"
    assert not chain.embedded.outlived, f"server processes {chain.embedded.outlived} outlived the run"
    assert chain.last.returncode == 0, chain.last.stderr[-3000:]
    _check_resumed(chain.embedded, chain.last.stdout)
    assert [r["step"] for r in rows(chain.out)] == list(range(1, chain.embedded.done + 2))


def _stop_after_a_step(
    args: list[str], env: dict[str, str], err: Path, daemons: Sequence[int] | None
) -> Stop:
    """Start the recipe in a process group of its own (the job's, as under a scheduler); once a step
    is in metrics.jsonl, SIGTERM to its process group and to every process of these ``daemons``
    (None: the run's own; their groups, and each descendant: the inference servers' processes
    too, as Slurm signals every process of a step); wait for the driver's exit. The servers'
    processes signalled are each checked to hold the SIGTERM pending (alive, serving until their
    owner stops them)."""
    with LiveRun(args, err, env=env, new_session=True) as run:
        run.until("step ")
        out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("run.out_dir=")))
        assert rows(out), "the run never finished a step"
        daemons = [run.pid] if daemons is None else daemons
        below = [p for d in daemons for p in descendants(d)]
        servers = _server_processes(below)
        for group in (run.pid, *daemons):
            os.killpg(group, signal.SIGTERM)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        # kill() queues a blocked signal before it returns; the driver stops the servers only
        # after its step and checkpoint, so each is still there holding it.
        for pid in servers:
            assert _holds_sigterm(pid), f"server process {pid} ({cmdline(pid)}) acted on the SIGTERM"
        returncode = run.finish(timeout_s=180)
    signalled = [*(d for d in daemons if d != run.pid), *servers]
    outlived = [pid for pid in signalled if not _wait_gone(pid, 60)]
    done = rows(out)[-1]["step"]
    checkpoints = out / "checkpoints"
    latest = (checkpoints / "latest").read_text().strip() if (checkpoints / "latest").exists() else ""
    saved = (checkpoints / f"step-{done}").is_dir()
    return Stop(returncode, run.output(), run.stderr(), done, latest, saved, servers, outlived)


def _server_processes(pids: Sequence[int]) -> list[int]:
    """The inference servers' processes among ``pids``, and the processes they started."""
    roots = [p for p in pids if "nodes.inference.server" in cmdline(p) or "sglang" in cmdline(p)]
    return sorted({*roots, *(c for r in roots for c in descendants(r))})


def _holds_sigterm(pid: int) -> bool:
    """Whether ``pid`` lives with a SIGTERM pending and blocked: held, never acted on (a SIGTERM
    pending but not blocked is one the process is about to act on)."""
    status = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
    )
    bit = 1 << (signal.SIGTERM - 1)
    pending = (int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)) & bit
    return bool(pending and int(status["SigBlk"], 16) & bit)


def _check_stopped(stop: Stop) -> None:
    """The run exited 143 with its last step's checkpoint on disk."""
    assert stop.returncode == 143, stop.err[-3000:]
    assert "terminated: shut down cleanly" in stop.err and "died" not in stop.err, stop.err[-3000:]
    assert "event stream" not in stop.err, stop.err[-3000:]  # leaving the cluster is no lost connection
    assert stop.done >= 1
    assert stop.latest == str(stop.done) and stop.saved


def _check_resumed(stop: Stop, next_stdout: str) -> None:
    """``--resume`` (the next run of the chain) continued from the stop's checkpoint."""
    assert f"resumed from step {stop.done} (policy version {stop.done};" in next_stdout, next_stdout[-3000:]


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
