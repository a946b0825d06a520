"""Online mode end to end: the recipe with ``[data] source = "online"`` trains 2 steps on sessions run
by a raw httpx client (not our code, not the OpenAI SDK), one of them across a weight push.

One recipe run (tiny model; batch 2 groups of 2 sessions, staleness bound 1: four slots at version 0)
shared by the tests. The client opens four tasks' sessions (A0, A1, B0, B1), finds the fifth refused
(429: nothing more admitted), makes every session's first turn, rewards the A sessions, waits for
step 1 (its weight push), then makes the B sessions' second turn and rewards them. Exactly the four
groups the run needs: it finishes only if none is lost, and the metrics name each trained group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_recipe import RECIPE, ROOT, rows

ARGS = [
    "model.tiny=true",
    "servers.n=1",  # nothing here needs a second server or rank: each is a process to start
    "trainer.n_ranks=1",
    "data.source=online",
    "rollout.workflow=nodes.rollout.sessions:OnlineWorkflow",
    "rollout.workflow_args.n_samples=2",
    "rollout.workflow_args.max_new_tokens=16",
    "async.batch_size=2",
    "async.max_staleness=1",
    "servers.reference.max_running_requests=16",
    "run.steps=2",
    "run.checkpoint_every=0",
    "metrics.plots=false",
    "metrics.tensorboard=false",
]


@dataclass
class Run:
    out: Path
    returncode: int = -1
    stdout: str = ""
    stderr: str = ""
    refused: list[int] = field(default_factory=list)  # statuses of the wrong-key, no-key and 5th-task opens
    retry_after: str = ""
    sessions: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # task -> its sessions' opens
    rewards: dict[str, dict[str, Any]] = field(default_factory=dict)  # session id -> the reward's answer


def _read_until(proc: subprocess.Popen[str], prefix: str, seen: list[str]) -> str:
    assert proc.stdout is not None
    while line := proc.stdout.readline():
        seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the recipe ended before printing {prefix!r}:\n{''.join(seen)}")


def _open(http: httpx.Client, url: str, task: str) -> dict[str, Any]:
    """Open a session, obeying 429's Retry-After until the run admits one."""
    deadline = time.monotonic() + 300
    while True:
        r = http.post(url, json={"task_id": task})
        if r.status_code != 429 or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            return r.json()
        time.sleep(float(r.headers["Retry-After"]))  # the protocol's back-off


def _chat(http: httpx.Client, base_url: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = http.post(f"{base_url}/chat/completions", json={"model": "policy", "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("online") / "run"
    result = Run(out)
    proc = subprocess.Popen(
        [sys.executable, str(RECIPE), *ARGS, f"run.out_dir={out}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    seen: list[str] = []
    try:
        _read_until(proc, "online: sessions at", seen)
        info = json.loads((out / "sessions.json").read_text())
        url, key = info["urls"][0], info["api_key"]
        with (
            httpx.Client(timeout=300) as anon,
            httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=300) as http,
        ):
            result.refused += [
                anon.post(url, json={"task_id": "x"}, headers={"Authorization": "Bearer wrong"}).status_code,
                anon.post(url, json={"task_id": "x"}).status_code,
            ]
            convo: dict[str, list[dict[str, Any]]] = {}
            for task in ("A0", "A1", "B0", "B1"):
                result.sessions[task] = [_open(http, url, task) for _ in range(2)]
            fifth = http.post(url, json={"task_id": "C"})  # every admitted slot is taken
            result.refused.append(fifth.status_code)
            result.retry_after = fifth.headers.get("Retry-After", "")
            for task, opened in result.sessions.items():  # every first turn, at version 0
                for s in opened:
                    convo[s["id"]] = [{"role": "user", "content": f"{task}: what is 2 + 3?"}]
                    convo[s["id"]].append(_chat(http, s["base_url"], convo[s["id"]]))
            for task in ("A0", "A1"):
                for reward, s in enumerate(result.sessions[task]):
                    result.rewards[s["id"]] = http.post(
                        f"{url}/{s['id']}/reward", json={"reward": reward}
                    ).json()
            _read_until(proc, "step 1/2", seen)  # trained on A, its weights pushed: version 1
            for task in ("B0", "B1"):
                for reward, s in enumerate(result.sessions[task]):
                    convo[s["id"]].append({"role": "user", "content": "Only the number."})
                    _chat(http, s["base_url"], convo[s["id"]])  # continues the turn of version 0
                    result.rewards[s["id"]] = http.post(
                        f"{url}/{s['id']}/reward", json={"reward": reward}
                    ).json()
        rest, result.stderr = proc.communicate(timeout=600)
        result.stdout = "".join(seen) + rest
        result.returncode = proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return result


pytestmark = pytest.mark.slow


def test_the_run_trains_two_steps_on_sessions(run: Run) -> None:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    m = rows(run.out)
    assert [r["step"] for r in m if "step" in r and "train/n_seqs" in r] == [1, 2]
    assert all(r["train/n_seqs"] == 4 for r in m if "train/n_seqs" in r)  # 2 groups x 2 sessions
    assert not any(k.startswith("eval/") for r in m for k in r)  # nothing held out: no evaluation
    assert (run.out / "sessions.json").stat().st_mode & 0o777 == 0o600  # the key: the run's user only


def test_every_rewarded_session_is_trained_once_none_lost(run: Run) -> None:
    m = [r for r in rows(run.out) if "data/groups" in r]
    trained = [g for r in m for g in r["data/groups"].split(",")]
    assert len(trained) == len(set(trained)) == 4  # none twice
    groups = {task: {s["group_id"] for s in opened} for task, opened in run.sessions.items()}
    assert all(len(g) == 1 for g in groups.values())  # a task's sessions: one group
    assert set(m[0]["data/groups"].split(",")) == groups["A0"] | groups["A1"]
    assert set(m[1]["data/groups"].split(",")) == groups["B0"] | groups["B1"]  # none lost across the push
    assert len(run.rewards) == 8 and all(r["trajectories"] == 1 for r in run.rewards.values())
    assert m[-1]["rollout/sessions_rewarded"] == 8 and m[-1]["rollout/sessions_timed_out"] == 0


def test_sessions_in_progress_across_a_weight_push_keep_their_tokens(run: Run) -> None:
    """The B sessions' first turns were made at version 0, their second after the push to version 1:
    one token sequence each (trajectories 1, above), trained at version 1 with tokens one version old."""
    step2 = [r for r in rows(run.out) if "data/groups" in r][1]
    assert step2["staleness/max"] == 1 and step2["version"] == 2


def test_wrong_or_missing_key_gets_401_and_creates_nothing(run: Run) -> None:
    assert run.refused[:2] == [401, 401]
    m = [r for r in rows(run.out) if "data/groups" in r]
    assert m[-1]["rollout/sessions_opened"] == 8  # the client's eight, nothing for the refused


def test_nothing_admitted_gets_429_with_retry_after(run: Run) -> None:
    assert run.refused[2] == 429 and int(run.retry_after) >= 1
    assert [r for r in rows(run.out) if "data/groups" in r][-1]["rollout/sessions_refused"] >= 1
