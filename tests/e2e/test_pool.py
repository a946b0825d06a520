"""The inference pool through the recipe, on reference servers: a killed server is replaced and
serves the current version."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.test_recipe import SMALL, _cmdline, _descendants, rows, start_until_first_step

# A replacement serves the current version within this of its server's death: two missed health
# probes (2 s), a reference server's start-up with the tiny model, and the next publish.
REPLACEMENT_BOUND_S = 60.0


def step_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step ")]


@pytest.mark.slow
def test_a_killed_server_is_replaced_and_serves_the_current_version(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc, lines = start_until_first_step([*SMALL, f"run.out_dir={out}"], 8, subprocess.DEVNULL)
    try:
        servers = [p for p in _descendants(proc.pid) if "nodes.inference.server" in _cmdline(p)]
        assert len(servers) == 2, "".join(lines)
        os.kill(servers[0], signal.SIGKILL)
        killed = time.monotonic()
        assert proc.stdout is not None
        joined_after = None
        rest = []
        for line in proc.stdout:
            rest.append(line)
            if joined_after is None and line.startswith("servers joined:"):
                joined_after = time.monotonic() - killed
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines + rest)
    assert proc.returncode == 0, output[-3000:]
    assert "launching a replacement" in output, output[-3000:]
    assert joined_after is not None and joined_after < REPLACEMENT_BOUND_S, output[-3000:]
    m = rows(out)
    assert [r["step"] for r in m] == list(range(1, 9))
    assert sum(r["servers/joined"] for r in m) == 1 and sum(r["servers/left"] for r in m) == 1
    assert m[-1]["servers/live"] == 2  # back to two
    back = next(i for i, r in enumerate(m) if r["servers/joined"])
    assert all(r["servers/live"] == 2 for r in m[back:])
    # every live server, the replacement included, holds the step's version at every step
    assert all(r["servers/min_weight_version"] == r["version"] for r in m)
    assert any("servers 2 (+1" in line for line in step_lines(output)), output[-3000:]
    assert all(r["train/n_seqs"] == 4 for r in m)
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == 16 and len(set(groups)) == 16  # no group lost or trained twice
