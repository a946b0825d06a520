"""The main job end to end with a tiny model: asynchronous steps, weight versions, staleness,
metrics, resume, and a server or the rollout actor killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodes.trace import read_trace

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
]


def recipe(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RECIPE), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
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
    assert names >= {"step", "wait", "train", "push", "eval", "train step", "proximal log-probs",
                     "forward/backward", "optimizer", "weight push", "pause servers", "send weights",
                     "resume servers", "gather", "broadcast", "generate", "episode"}  # fmt: skip
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


@pytest.mark.slow
def test_three_async_steps_then_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = recipe([*SMALL, "run.steps=3", "run.checkpoint_every=3", f"run.out_dir={out}"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "GSM8K-style problems generated offline" in first.stdout
    m = rows(out)
    assert [r["step"] for r in m] == [1, 2, 3]
    for r in m:
        assert r["train/n_seqs"] == 4  # batch_size 2 groups x 2 samples: every step trained on trajectories
        assert r["servers/min_weight_version"] == r["step"] == r["version"]  # every server got every version
        assert 0 <= r["staleness/max"] <= 2  # no trajectory older than the bound
    assert "eval/accuracy" in m[-1] and m[-1]["eval/version"] == 3  # evaluated the final weights
    assert (out / "run.png").stat().st_size > 10_000
    assert (out / "checkpoints" / "step-3").is_dir()
    assert f"checkpoint {out / 'checkpoints' / 'step-3'}" in first.stdout
    check_timeline(out)

    second = recipe([*SMALL, "run.steps=5", "run.checkpoint_every=5", f"run.out_dir={out}", "--resume"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert (
        "resumed from step 3 (policy version 3; data: 0 epochs done, 6 prompts of the next trained)"
        in second.stdout
    )
    m = rows(out)
    assert [r["step"] for r in m] == [1, 2, 3, 4, 5]
    assert [r["servers/min_weight_version"] for r in m[3:]] == [4, 5]
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == 10 and len(set(groups)) == 10  # no prompt trained twice across the restart


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def start_until_first_step(
    args: list[str], steps: int, stderr: int
) -> tuple[subprocess.Popen[str], list[str]]:
    """Start the recipe and read its output until step 1 is done; returns the process and the lines read."""
    proc = subprocess.Popen(
        [sys.executable, str(RECIPE), *args, f"run.steps={steps}"],
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


@pytest.mark.slow
def test_run_finishes_after_kill_9_of_an_inference_server(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc, lines = start_until_first_step([*SMALL, f"run.out_dir={out}"], 4, subprocess.DEVNULL)
    try:
        servers = [p for p in _descendants(proc.pid) if "nodes.inference.server" in _cmdline(p)]
        assert len(servers) == 2, "".join(lines)
        os.kill(servers[0], signal.SIGKILL)
        rest, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines) + rest
    assert proc.returncode == 0, output[-3000:]
    assert "servers down" in output
    m = rows(out)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    assert all(r["train/n_seqs"] == 4 for r in m)


@pytest.mark.slow
def test_kill_9_of_a_trainer_rank_stops_the_run_with_a_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc, _ = start_until_first_step(
        [*SMALL, f"run.out_dir={out}", "run.checkpoint_every=50"], 50, subprocess.PIPE
    )
    try:
        workers = [p for p in _descendants(proc.pid) if "rlactors.worker" in _cmdline(p)]
        ranks = [p for p in workers if "rlactors.worker trainer-1" in _cmdline(p)]
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=300)  # never a hang
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert "error: actor trainer-1" in err and "SIGKILL" in err and "--resume" in err
    # Nothing of the run is left behind: every worker it had is gone.
    assert len(workers) >= 5
    assert not [p for p in workers if Path(f"/proc/{p}").exists() and "rlactors.worker" in _cmdline(p)]


@pytest.mark.slow
def test_sigterm_checkpoints_the_last_step_and_shuts_down_like_ctrl_c(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc, _ = start_until_first_step(
        [*SMALL, f"run.out_dir={out}", "run.checkpoint_every=50"], 50, subprocess.PIPE
    )
    try:
        left = [
            p
            for p in _descendants(proc.pid)
            if "rlactors.worker" in _cmdline(p) or "nodes.inference" in _cmdline(p)
        ]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)  # never a hang
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert "terminated: shut down cleanly" in err and "Traceback" not in err
    assert len(left) >= 7  # 2 trainer ranks, 2 server actors and their servers, governor, buffer, rollout
    assert not [p for p in left if Path(f"/proc/{p}").exists() and _cmdline(p)]  # nothing left running
    # checkpoint_every = 50: the last completed step was saved on the way out, and the message names it
    done = rows(out)[-1]["step"]
    assert (out / "checkpoints" / "latest").read_text().strip() == str(done)
    assert f"continue from {out / 'checkpoints' / f'step-{done}'} with --resume" in err
    again = recipe(
        [*SMALL, f"run.steps={done + 1}", "run.checkpoint_every=50", f"run.out_dir={out}", "--resume"]
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {done} (policy version {done};" in again.stdout
    m = rows(out)
    assert [r["step"] for r in m] == list(range(1, done + 2))
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == len(set(groups))  # nothing trained twice across the stop


@pytest.mark.slow
def test_run_finishes_after_kill_9_of_the_rollout_actor(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc, lines = start_until_first_step([*SMALL, f"run.out_dir={out}"], 4, subprocess.PIPE)
    try:
        rollout = [p for p in _descendants(proc.pid) if "rlactors.worker rollout-0" in _cmdline(p)]
        assert len(rollout) == 1, "".join(lines)
        os.kill(rollout[0], signal.SIGKILL)
        rest, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, ("".join(lines) + rest + err)[-3000:]
    assert "rollout actors restarted after dying: 1 so far" in rest
    m = rows(out)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    assert m[-1]["rollout/restarts"] == 1
    assert all(r["train/n_seqs"] == 4 for r in m)  # every step trained a full batch
    assert all(0 <= r["staleness/max"] <= 2 for r in m)  # the re-run episodes kept to the bound
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == 8 and len(set(groups)) == 8  # no group lost or trained twice
