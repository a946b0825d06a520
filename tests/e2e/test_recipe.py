"""The main job end to end with a tiny model: asynchronous steps, weight versions, staleness,
metrics, resume, SIGTERM, and a server, the rollout actor or a trainer rank killed mid-run.

Five runs carry the scenarios (each run costs a minute of CPU, mostly start-up): a run that
finishes, resumed and stopped by SIGTERM, then resumed again (module fixtures, one test each);
one run with the rollout actor and a server killed; one with a trainer rank killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from nodes.common.trace import read_trace
from tests.e2e.live_run import LiveRun
from tests.helpers import forked
from tests.helpers.processes import cmdline

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "gsm8k_grpo.py"
SMALL = [
    "model.tiny=true",
    "data.source=offline",
    "data.eval_size=4",
    "async.batch_size=2",
    "async.max_staleness=2",
    "rollout.workflow_args.n_samples=2",
    "rollout.workflow_args.max_new_tokens=16",
    "servers.reference.max_running_requests=16",
    "metrics.plots=false",  # run.png and timeline.png: ~2 CPU-s a run; the runs that check them turn them on
    "metrics.tensorboard=false",  # ~2.5 CPU-s a run (torch.utils.tensorboard); test_smoke_config checks it
]


def recipe(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return forked.run(
        [sys.executable, str(RECIPE), *args],
        preload=forked.DRIVER,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_timeline(out: Path) -> None:
    """trace.json is trace-event JSON with every phase, complete spans nest on each track, and a
    trajectory's trace id is on its generate span and on the train step that consumed it."""
    events = read_trace(out / "trace.json")
    json.loads((out / "trace.json").read_text())  # closed: strict JSON
    names = {e["name"] for e in events if e.get("ph") in ("X", "b")}
    assert names >= {
        "step",
        "wait",
        "train",
        "push",
        "eval",
        "train step",
        "proximal log-probs",
        "forward/backward",
        "optimizer",
        "weight push",
        "pause servers",
        "send weights",
        "resume servers",
        "gather",
        "broadcast",
        "generate",
        "episode",
    }
    assert {e["name"] for e in events if e.get("ph") == "C"} == {"governor", "buffer"}
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in tracks.values():
        for a0, a1 in spans:
            for b0, b1 in spans:  # disjoint, or one inside the other
                assert (
                    a1 <= b0 + 1
                    or b1 <= a0 + 1
                    or (a0 <= b0 + 1 and b1 <= a1 + 1)
                    or (b0 <= a0 + 1 and a1 <= b1 + 1)
                )
    trained = {i for e in events if e.get("name") == "train step" for i in e["args"]["trace_ids"]}
    generated = {e["args"]["trace_id"] for e in events if e.get("ph") == "b" and e["name"] == "generate"}
    assert trained and trained <= generated  # every trained trajectory's requests are on the timeline
    assert (out / "timeline.png").stat().st_size > 10_000


# The scenarios that need one trainer rank run with one (a second costs a process start-up);
# two servers stay: every server gets every version, and one of two is killed.
ONE_RANK = [*SMALL, "trainer.n_ranks=1"]


@dataclass
class Finished:
    """A run of three steps that finished, checkpointing its last; what it left, kept before the
    runs resumed from it write to the same folder."""

    out: Path
    done: subprocess.CompletedProcess[str]
    rows: list[dict]
    kept: Path  # its trace.json and timeline.png


@dataclass
class Stopped:
    """A run resumed from :class:`Finished`'s checkpoint and stopped by SIGTERM after its first step."""

    run: LiveRun
    returncode: int
    left: list[int]  # the run's workers and servers when it was signalled
    rows: list[dict]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    out = tmp_path_factory.mktemp("chain") / "run"
    done = recipe(
        [*ONE_RANK, "run.steps=3", "run.checkpoint_every=3", "metrics.plots=true", f"run.out_dir={out}"]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kept = out.parent / "first"
    kept.mkdir()
    for name in ("trace.json", "timeline.png"):
        shutil.copy(out / name, kept / name)
    return Finished(out, done, rows(out), kept)


@pytest.fixture(scope="module")
def stopped(finished: Finished) -> Stopped:
    out = finished.out
    args = [*ONE_RANK, "run.steps=50", "run.checkpoint_every=50", f"run.out_dir={out}", "--resume"]
    with LiveRun(args, out.parent / "stopped.err") as run:
        run.until("step 4/50")
        left = sorted({*run.processes("rlactors.node.worker"), *run.processes("nodes.inference")})
        run.proc.send_signal(signal.SIGTERM)
        returncode = run.finish(timeout_s=120)  # never a hang
    return Stopped(run, returncode, left, rows(out))


@pytest.fixture(scope="module")
def resumed_again(finished: Finished, stopped: Stopped) -> subprocess.CompletedProcess[str]:
    done = stopped.rows[-1]["step"]
    return recipe(
        [
            *ONE_RANK,
            f"run.steps={done + 1}",
            "run.checkpoint_every=50",
            f"run.out_dir={finished.out}",
            "--resume",
        ]
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_async_steps(finished: Finished) -> None:
    out, m = finished.out, finished.rows
    assert "GSM8K-style problems generated offline" in finished.done.stdout
    assert [r["step"] for r in m] == [1, 2, 3]
    for r in m:
        assert r["train/n_seqs"] == 4  # batch_size 2 groups x 2 samples: every step trained on trajectories
        assert r["servers/min_weight_version"] == r["step"] == r["version"]  # every server got every version
        assert 0 <= r["staleness/max"] <= 2  # no trajectory older than the bound
    assert "eval/accuracy" in m[-1] and m[-1]["eval/version"] == 3  # evaluated the final weights
    assert (out / "run.png").stat().st_size > 10_000
    assert (out / "checkpoints" / "step-3").is_dir()
    assert f"checkpoint {out / 'checkpoints' / 'step-3'}" in finished.done.stdout
    check_timeline(finished.kept)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_finished_run_resumes_from_its_last_checkpoint(stopped: Stopped) -> None:
    assert (
        "resumed from step 3 (policy version 3; data: 0 epochs done, 6 prompts of the next trained)"
        in stopped.run.output()
    ), stopped.run.stderr()[-3000:]
    m = stopped.rows
    assert [r["step"] for r in m] == list(range(1, len(m) + 1)) and len(m) >= 4
    assert all(
        r["servers/min_weight_version"] == r["step"] for r in m[3:]
    )  # the resumed versions reach every server
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == 2 * len(m) and len(set(groups)) == len(
        groups
    )  # no prompt trained twice across the restart


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_checkpoints_the_last_step_and_shuts_down_like_ctrl_c(
    finished: Finished, stopped: Stopped
) -> None:
    out, err = finished.out, stopped.run.stderr()
    assert stopped.returncode == 143, err[-3000:]
    assert "terminated: shut down cleanly" in err and "Traceback" not in err
    assert (
        len(stopped.left) >= 7
    )  # a trainer rank, 2 server actors and their servers, governor, buffer, rollout
    assert not [p for p in stopped.left if Path(f"/proc/{p}").exists() and cmdline(p)]  # nothing left running
    # checkpoint_every = 50: the last completed step was saved on the way out, and the message names it
    done = stopped.rows[-1]["step"]
    assert done >= 4
    assert (out / "checkpoints" / "latest").read_text().strip() == str(done)
    assert f"continue from {out / 'checkpoints' / f'step-{done}'} with --resume" in err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_stopped_by_sigterm_resumes(
    finished: Finished, stopped: Stopped, resumed_again: subprocess.CompletedProcess[str]
) -> None:
    assert resumed_again.returncode == 0, resumed_again.stderr[-3000:]
    done = stopped.rows[-1]["step"]
    assert f"resumed from step {done} (policy version {done};" in resumed_again.stdout
    m = rows(finished.out)
    assert [r["step"] for r in m] == list(range(1, done + 2))
    assert m[-1]["servers/min_weight_version"] == done + 1
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == 2 * (done + 1) and len(groups) == len(
        set(groups)
    )  # nothing trained twice across the stop


def start_until_first_step(args: list[str], steps: int, stderr: int) -> tuple[forked.Process, list[str]]:
    """Start the recipe and read its output until step 1 is done; returns the process and the lines read."""
    proc = forked.popen(
        [sys.executable, str(RECIPE), *args, f"run.steps={steps}"],
        preload=forked.DRIVER,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith(f"step 1/{steps}") or not line:
            break
    return proc, lines


@dataclass
class Faulted:
    """A run of five steps whose rollout actor was killed (kill -9) after step 1 and one of its two
    inference servers after step 2: each fault with three steps still to train."""

    run: LiveRun
    returncode: int
    rows: list[dict]


@pytest.fixture(scope="module")
def faulted(tmp_path_factory: pytest.TempPathFactory) -> Faulted:
    out = tmp_path_factory.mktemp("faulted") / "run"
    with LiveRun([*ONE_RANK, "run.steps=5", f"run.out_dir={out}"], out.parent / "err") as run:
        run.until("step 1/5")
        rollout = run.processes("rlactors.node.worker rollout-0")
        assert len(rollout) == 1, run.output()
        os.kill(rollout[0], signal.SIGKILL)
        run.until("step 2/5")
        servers = run.processes("nodes.inference.server")
        assert len(servers) == 2, run.output()
        os.kill(servers[0], signal.SIGKILL)
        returncode = run.finish()
    return Faulted(run, returncode, rows(out))


def check_finished_all_steps(f: Faulted) -> None:
    assert f.returncode == 0, (f.run.output() + f.run.stderr())[-3000:]
    m = f.rows
    assert [r["step"] for r in m] == [1, 2, 3, 4, 5]
    assert all(r["train/n_seqs"] == 4 for r in m)  # every step trained a full batch
    assert all(0 <= r["staleness/max"] <= 2 for r in m)  # the re-run episodes kept to the bound
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == 10 and len(set(groups)) == 10  # no group lost or trained twice


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_finishes_after_kill_9_of_the_rollout_actor(faulted: Faulted) -> None:
    check_finished_all_steps(faulted)
    assert "rollout actors restarted after dying: 1 so far" in faulted.run.output()
    assert faulted.rows[-1]["rollout/restarts"] == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_finishes_after_kill_9_of_an_inference_server(faulted: Faulted) -> None:
    check_finished_all_steps(faulted)
    assert "servers down" in faulted.run.output()


@pytest.mark.slow
def test_kill_9_of_a_trainer_rank_stops_the_run_with_a_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "run"  # two ranks (one is killed), one server
    args = [*SMALL, "servers.n=1", "run.steps=50", "run.checkpoint_every=50", f"run.out_dir={out}"]
    with LiveRun(args, tmp_path / "err") as run:
        run.until("step 1/50")
        workers = run.processes("rlactors.node.worker")
        ranks = [p for p in workers if "rlactors.node.worker trainer-1" in cmdline(p)]
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        returncode = run.finish(timeout_s=300)  # never a hang
    err = run.stderr()
    assert returncode == 1, err[-3000:]
    assert "error: actor trainer-1" in err and "SIGKILL" in err and "--resume" in err
    # Nothing of the run is left behind: every worker it had is gone.
    assert len(workers) >= 5  # 2 trainer ranks, a server actor, governor, buffer, rollout
    assert not [p for p in workers if Path(f"/proc/{p}").exists() and "rlactors.node.worker" in cmdline(p)]
