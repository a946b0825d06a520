"""Every run reachable: an embedded run records its head address and a credential (mode 600) in its
run folder and the state folder while it runs; ``rlactors status|stack|pool --run RUN_DIR`` reach
it, and with no flag the only live run; the records go when it ends, and a --run that names no
live run is one line and exit 2."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlactors.api.runs import RECORD, SECRET

ROOT = Path(__file__).resolve().parents[2]


def rlactors_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlactors.launch.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


class Run:
    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.folder = folder
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/cluster/embedded_driver.py"), str(folder)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("ready"), line
        self.flags = line.split(" ", 1)[1].strip()

    def end(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def runs(cli_env: dict[str, str], tmp_path: Path) -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for r in started:
        r.end()


def test_an_embedded_run_is_reached_by_its_folder_then_forgotten(
    runs: list[Run], cli_env: dict[str, str], tmp_path: Path
) -> None:
    run = Run(cli_env, tmp_path / "run")
    runs.append(run)
    assert run.flags == f"--run {run.folder}"
    secret = run.folder / SECRET
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    record = json.loads((run.folder / RECORD).read_text())
    assert record["pid"] == run.proc.pid and record["address"].startswith("ipc://")
    (state,) = (Path(cli_env["RLACTORS_STATE_DIR"]) / "runs").iterdir()
    assert json.loads((state / RECORD).read_text())["run_dir"] == str(run.folder)

    status = rlactors_cli(cli_env, "status", "--run", str(run.folder), "--json")
    assert status.returncode == 0, status.stderr
    assert [a["name"] for a in json.loads(status.stdout)["actors"]] == ["counter"]
    stack = rlactors_cli(cli_env, "stack", "--run", str(run.folder))
    assert stack.returncode == 0 and stack.stdout.startswith("stacks of 1 actor"), stack.stderr
    pool = rlactors_cli(cli_env, "pool", "ls", "--run", str(run.folder))  # reached: it has no pool
    assert pool.returncode == 1 and "no inference-pool actor in this cluster" in pool.stderr
    # no flag: the only live run
    status = rlactors_cli(cli_env, "status", "--json")
    assert status.returncode == 0 and "counter" in status.stdout, status.stderr

    run.end()
    assert run.proc.returncode == 0
    assert not secret.exists() and not (run.folder / RECORD).exists()
    assert not (state / RECORD).exists()
    gone = rlactors_cli(cli_env, "stack", "--run", str(run.folder))
    assert gone.returncode == 2 and "no live run is recorded there" in gone.stderr, gone.stderr
    assert len(gone.stderr.strip().splitlines()) == 1 and "Traceback" not in gone.stderr


def test_two_live_runs_need_a_run_flag_and_a_folder_without_one_is_refused(
    runs: list[Run], cli_env: dict[str, str], tmp_path: Path
) -> None:
    runs += [Run(cli_env, tmp_path / "a"), Run(cli_env, tmp_path / "b")]
    both = rlactors_cli(cli_env, "stack")
    assert both.returncode == 2, both.stderr
    assert "2 runs are live here" in both.stderr and f"--run {tmp_path / 'a'}" in both.stderr
    assert f"--run {tmp_path / 'b'}" in both.stderr
    b = rlactors_cli(cli_env, "status", "--run", str(tmp_path / "b"), "--json")
    assert b.returncode == 0 and "counter" in b.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    for bad in (empty, tmp_path / "nowhere"):
        r = rlactors_cli(cli_env, "status", "--run", str(bad))
        assert r.returncode == 2 and "Traceback" not in r.stderr and f"--run {bad}" in r.stderr, r.stderr
