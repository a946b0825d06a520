"""Launch N local ranks of a script the way the runtime will: env RANK/WORLD_SIZE/MASTER_* set."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(
    script: Path, args: list[str], world: int, extra_env: dict | None = None
) -> list[subprocess.Popen]:
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
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
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
    procs = spawn_ranks(script, args, world, extra_env)
    outputs = []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop(procs)
                out = (p.stdout.read() if p.stdout else "") + "\n<timed out>"
            outputs.append(out)
    finally:
        stop(procs)
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        dump = "\n".join(
            f"--- rank {r} (rc {procs[r].returncode}) ---\n{o[-4000:]}" for r, o in enumerate(outputs)
        )
        raise RuntimeError(f"ranks {bad} failed\n{dump}")
    return outputs
