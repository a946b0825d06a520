"""Preemption as schedulers deliver it (issue 39, item 5): Slurm, ``timeout`` and systemd send
SIGTERM to every process of the job at once, not to the driver alone. Either way the recipe
finishes its step, checkpoints it, exits 143, and ``--resume`` continues from that checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_recipe import RECIPE, ROOT, SMALL, recipe, rows


@pytest.mark.slow
@pytest.mark.parametrize("to", ["driver", "group"])
def test_sigterm_to_the_driver_or_its_whole_process_group_checkpoints_and_resumes(
    tmp_path: Path, to: str
) -> None:
    out = tmp_path / "run"
    args = [*SMALL, f"run.out_dir={out}", "run.checkpoint_every=50"]  # no checkpoint but the one at the stop
    proc = subprocess.Popen(
        [sys.executable, str(RECIPE), *args, "run.steps=50"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,  # the job's own process group, as under a scheduler
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and (line := proc.stdout.readline()):
            if line.startswith("step 1/"):  # metrics.jsonl has step 1's line
                break
        assert rows(out), "the run never finished step 1"
        if to == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert "terminated: shut down cleanly" in err and "died" not in err, err[-3000:]
    done = rows(out)[-1]["step"]
    assert done >= 1
    assert (out / "checkpoints" / "latest").read_text().strip() == str(done)
    assert (out / "checkpoints" / f"step-{done}").is_dir()
    again = recipe([*args, f"run.steps={done + 1}", "--resume"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {done} (policy version {done};" in again.stdout
    assert [r["step"] for r in rows(out)] == list(range(1, done + 2))
