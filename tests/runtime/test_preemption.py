"""A scheduler's signal sent to the whole job (process group) reaches an embedded cluster's workers
too; they leave it to their driver, which still has them while it stops (issue 39, item 5). The
recipe's own run under such a SIGTERM is tested in tests/e2e/test_preemption.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests/runtime/preempted_driver.py"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("to", ["driver", "group"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_driver_or_its_whole_group_leaves_the_actors_to_the_driver(
    tmp_path: Path, to: str, sig: signal.Signals
) -> None:
    marker = tmp_path / "on_stop"
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), str(marker)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a job under a scheduler has
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().split()
        assert first[:1] == ["ready"], first
        worker = int(first[1])
        if to == "group":
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), err[-3000:]
    # The actor answered after the signal and had not stopped on its own ...
    assert out.splitlines() == [f"after {sig.name} ok 2", "on_stop not yet run"], err[-3000:]
    # ... and when the driver stopped it, it stopped cleanly (its on_stop ran) and is gone.
    assert marker.read_text() == "stopped\n"
    assert not _alive(worker)
