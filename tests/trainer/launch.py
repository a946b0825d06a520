"""Launch N local ranks of a script the way the runtime will: env RANK/WORLD_SIZE/MASTER_* set.

The ranks are forked, as a node agent forks trainer ranks: from one fork server per test process
(:mod:`rlactors.forkserver`, started at the first launch, torch and the trainer's modules imported
once), each script run as its module (``tests.trainer.dist_worker``). Where the server would not
fork (an environment it cannot give a child), the ranks are exec'd as ``python SCRIPT``.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from rlactors.forkserver import PIPE, ForkServer

REPO = Path(__file__).resolve().parents[2]
# what a rank imports before its first line runs: the trainer rank's modules (and theirs)
PRELOAD = ["nodes.trainer.rank"]
_server: subprocess.Popen | None = None
_socket = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_envs(world: int, extra_env: dict | None = None) -> list[dict[str, str]]:
    port = free_port()
    return [
        {
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
        for rank in range(world)
    ]


def spawn_ranks(
    script: Path, args: list[str], world: int, extra_env: dict | None = None
) -> list[subprocess.Popen]:
    """Exec ``world`` ranks (``python SCRIPT ARGS``), their output piped."""
    return [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for env in rank_envs(world, extra_env)
    ]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _fork_server() -> tuple[str, int]:
    """This process's fork server (started at the first call): its socket and pid."""
    global _server, _socket
    if _server is None or _server.poll() is not None:
        _socket = os.path.join(tempfile.mkdtemp(prefix="rlactors-ranks-"), "fork.sock")
        _server = subprocess.Popen(
            [sys.executable, "-m", "rlactors.forkserver", _socket, str(os.getpid())],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        assert _server.stdout is not None
        if _server.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the ranks' fork server did not start (exit code {_server.wait()})")
        atexit.register(_server.kill)
    return _socket, _server.pid


async def _run_forked(
    module: str, args: list[str], envs: list[dict[str, str]], timeout: float
) -> tuple[list[str], list[int | None]] | None:
    """Fork the ranks and wait for them; None when the server would not fork them."""
    fork = await ForkServer.connect(*_fork_server())
    try:
        procs = []
        for env in envs:
            proc = await fork.spawn(
                module,
                args,
                env=env,
                cwd=str(REPO),
                preload=PRELOAD,
                stdout=PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            if proc is None:
                return None  # the ones already forked die as the connection closes
            procs.append(proc)
        chunks: list[list[bytes]] = [[] for _ in procs]

        async def collect(proc, into: list[bytes]) -> None:
            while data := await proc.stdout.read(65536):
                into.append(data)
            await proc.wait()

        tasks = [asyncio.ensure_future(collect(p, c)) for p, c in zip(procs, chunks, strict=True)]
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for proc, task, into in zip(procs, tasks, chunks, strict=True):
            if task in pending:
                proc.kill()
                into.append(b"\n<timed out>")
        await asyncio.gather(*tasks, return_exceptions=True)
        return [b"".join(c).decode(errors="replace") for c in chunks], [p.returncode for p in procs]
    finally:
        await fork.close()  # kills any child still running


def _run_execd(
    script: Path, args: list[str], world: int, timeout: float, extra_env: dict | None
) -> tuple[list[str], list[int | None]]:
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
    return outputs, [p.returncode for p in procs]


def run_ranks(
    script: Path, args: list[str], world: int, timeout: float = 120, extra_env: dict | None = None
) -> list[str]:
    """Run ``world`` ranks to completion; raise with every rank's output if one fails or times out.

    Not from a running event loop's thread (``asyncio.to_thread(run_ranks, ...)`` there)."""
    module = ".".join(Path(script).resolve().relative_to(REPO).with_suffix("").parts)
    ran = asyncio.run(_run_forked(module, args, rank_envs(world, extra_env), timeout))
    outputs, codes = ran if ran is not None else _run_execd(script, args, world, timeout, extra_env)
    bad = [r for r, rc in enumerate(codes) if rc != 0]
    if bad:
        dump = "\n".join(f"--- rank {r} (rc {codes[r]}) ---\n{o[-4000:]}" for r, o in enumerate(outputs))
        raise RuntimeError(f"ranks {bad} failed\n{dump}")
    return outputs
