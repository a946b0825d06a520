"""Launch N local ranks of a script the way the runtime will: env RANK/WORLD_SIZE/MASTER_* set.

The ranks are forked from the test process's fork server (:mod:`tests.helpers.forked`), as a node
agent forks trainer ranks, with torch and the trainer's modules imported once; exec'd where it
would not fork.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.helpers import forked

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(
    script: Path, args: list[str], world: int, out: list[Any], extra_env: dict | None = None
) -> list[Any]:
    """Start ``world`` ranks of ``python SCRIPT ARGS``, rank r's output (stdout and stderr) to ``out[r]``."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            **(extra_env or {}),
        }
        procs.append(
            forked.popen(
                [sys.executable, str(script), *args],
                preload=forked.TRAINER,
                env=env,
                cwd=REPO,
                stdout=out[rank],
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def stop(procs: list[Any]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_ranks(
    script: Path, args: list[str], world: int, timeout: float = 120, extra_env: dict | None = None
) -> list[str]:
    """Run ``world`` ranks to completion; raise with every rank's output if one fails or times out."""
    files = [tempfile.TemporaryFile() for _ in range(world)]
    outputs: list[str] = []
    procs: list[Any] = []
    try:
        procs = spawn_ranks(script, args, world, files, extra_env)
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            for p in procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:
            stop(procs)
        outputs = [forked.read_back(f) + ("\n<timed out>" if timed_out else "") for f in files]
    finally:
        for f in files:
            f.close()
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        dump = "\n".join(
            f"--- rank {r} (rc {procs[r].returncode}) ---\n{o[-4000:]}" for r, o in enumerate(outputs)
        )
        raise RuntimeError(f"ranks {bad} failed\n{dump}")
    return outputs
