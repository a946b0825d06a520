"""Online mode as a service: ``run.steps = 0`` runs until stopped, and a quiet period with no sessions
is a wait the run logs, not an error.

One recipe run (tiny model, batch 1 group of 2 sessions) with ``run.batch_timeout_s = 1``: the short
stand-in for a service's long quiet hours. It idles through three such periods before any session
comes (each one used to end the run with exit code 1), trains one step on a client's sessions, idles
again, and stops on SIGTERM: exit 143, the step it trained checkpointed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_online import ARGS, _chat, _open, _read_until
from tests.e2e.test_recipe import RECIPE, ROOT, rows

SERVICE = [
    *(a for a in ARGS if not a.startswith(("run.steps=", "async.batch_size="))),
    "run.steps=0",
    "async.batch_size=1",
    "run.batch_timeout_s=1",
]
WAITING = "online: waiting for sessions"

pytestmark = pytest.mark.slow


def test_an_online_run_with_no_step_limit_waits_trains_and_stops_on_sigterm(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(RECIPE), *SERVICE, f"run.out_dir={out}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    seen: list[str] = []
    try:
        _read_until(proc, "online: sessions at", seen)
        for _ in range(3):  # three quiet periods, no session yet: the run waits on
            _read_until(proc, WAITING, seen)
        assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
        info = json.loads((out / "sessions.json").read_text())
        url, key = info["urls"][0], info["api_key"]
        with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=300) as http:
            for reward, s in enumerate(_open(http, url, "late") for _ in range(2)):
                _chat(http, s["base_url"], [{"role": "user", "content": "What is 2 + 3?"}])
                assert http.post(f"{url}/{s['id']}/reward", json={"reward": reward}).status_code == 200
        step = _read_until(proc, "step 1 ", seen)  # no "/N": the run has no last step
        assert step.startswith("step 1 | ")
        _read_until(proc, WAITING, seen)  # idle again after training, not ended
        proc.send_signal(signal.SIGTERM)
        rest, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    stdout = "".join(seen) + rest
    assert proc.returncode == 143, stdout[-3000:] + stderr[-3000:]
    assert "groups within" not in stdout + stderr  # no quiet period was an error (its message)
    assert (out / "checkpoints" / "latest").read_text().strip() == "1"  # the trained step, saved at SIGTERM
    trained = [r for r in rows(out) if "train/n_seqs" in r]
    assert [r["step"] for r in trained] == [1] and trained[0]["train/n_seqs"] == 2
