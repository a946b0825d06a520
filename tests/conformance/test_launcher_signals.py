"""A server started by the launcher is its owner's to stop (issue 39): a scheduler's SIGTERM to the
job's process group does not reach it, one sent to its pid stays pending (blocked), its owner stops
it with SIGINT, and the kernel kills it when its owner dies, however the owner ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.helpers.processes import gone

ROOT = Path(__file__).resolve().parents[2]

# An owner process: starts a reference server (sim backend), prints its pid and URL, then on each
# line of stdin: "health" (prints whether it answers), "stop" (stops it, prints its exit code).
# Its answers start with "@" (its log lines come on stdout too).
OWNER = """
import asyncio, sys
from nodes.inference.launcher import ReferenceServerConfig, ServerSupervisor

async def main():
    sup = ServerSupervisor(ReferenceServerConfig(backend="sim"), startup_timeout_s=120)
    await sup.start()
    print("@", sup.proc.pid, sup.url, flush=True)
    loop = asyncio.get_running_loop()
    while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
        if line == "health":
            print("@", await sup.health(), flush=True)
        elif line == "stop":
            await sup.stop()
            print("@", sup.proc.returncode, flush=True)

asyncio.run(main())
"""


def held(pid: int, sig: signal.Signals) -> bool:
    """Whether ``sig`` is pending and blocked in ``pid``: held, never acted on."""
    fields = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
    )
    bit = 1 << (sig - 1)
    pending = (int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)) & bit
    return bool(pending and int(fields["SigBlk"], 16) & bit)


def _owner() -> tuple[subprocess.Popen[str], int, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the job's process group, as under a scheduler
    )
    pid, url = _answer(proc).split()
    return proc, int(pid), url


def _answer(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    while (line := proc.stdout.readline()) and not line.startswith("@ "):
        pass
    assert line, "the owner exited"
    return line[2:].strip()


def _ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return _answer(proc)


def _end(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_scheduler_sigterm_is_held_until_the_owner_stops_the_server() -> None:
    proc, server, url = _owner()
    try:
        assert os.getpgid(server) == server != os.getpgid(proc.pid)  # its own session and group
        os.kill(server, signal.SIGTERM)  # Slurm's way: to each process of the job
        assert held(server, signal.SIGTERM)
        assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
        assert _ask(proc, "health") == "True"
        assert _ask(proc, "stop") == "0"  # SIGINT: a clean exit
        assert gone(server)
    finally:
        _end(proc)


def test_a_server_dies_with_its_owner() -> None:
    proc, server, _ = _owner()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the owner killed outright: no stop() runs
        proc.wait()
        assert gone(server), f"server {server} outlived its owner"
    finally:
        _end(proc)
