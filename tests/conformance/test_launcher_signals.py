"""A server started by the launcher is its owner's to stop (issue 39): a scheduler's SIGTERM to the
job's process group does not reach it, one sent to its pid stays pending (blocked), its owner stops
it with SIGINT, and it dies when its owner dies, however the owner ends; exec'd by its owner or
forked from its node's fork server. Real SGLang is
started with a bootstrap that keeps SIGTERM ignored in each of its processes, whatever handlers it
installs (here in miniature; on real SGLang: tests/sglang/test_sglang_signals.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nodes.inference.launcher import HOLD_SIGTERM_BOOT, SGLANG_CPU_SHIM, ServerSupervisor, SGLangServerConfig
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


@pytest.fixture(params=["exec", "fork"])
def owner_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The owner's environment. It starts its server exec'd, or forked from a fork server
    (rlactors.node.forkserver), as in a worker its node agent forked: the variables that name the
    server say so. The fork server runs with the same environment, or it would not fork."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if request.param == "exec":
        yield env
        return
    path = tmp_path / "fork.sock"
    server = subprocess.Popen(
        [sys.executable, "-m", "rlactors.node.forkserver", str(path), str(os.getpid())],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield {**env, "RLACTORS_FORKSERVER": str(path), "RLACTORS_FORKSERVER_PID": str(server.pid)}
    finally:
        server.kill()
        server.wait()


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _owner(env: dict[str, str]) -> tuple[subprocess.Popen[str], int, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the job's process group, as under a scheduler
    )
    pid, url = _answer(proc).split()
    # forked: the fork server's child; exec'd: the owner's
    assert parent(int(pid)) == int(env.get("RLACTORS_FORKSERVER_PID", proc.pid))
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


def test_a_scheduler_sigterm_is_held_until_the_owner_stops_the_server(owner_env: dict[str, str]) -> None:
    proc, server, url = _owner(owner_env)
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


def test_a_server_dies_with_its_owner(owner_env: dict[str, str]) -> None:
    proc, server, _ = _owner(owner_env)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the owner killed outright: no stop() runs
        proc.wait()
        assert gone(server), f"server {server} outlived its owner"
    finally:
        _end(proc)


# What SGLang does with SIGTERM, in miniature: a handler of its own (signal.signal), one on its event
# loop (loop.add_signal_handler, as its tokenizer manager and HTTP server add theirs), and a process
# spawned by multiprocessing (its scheduler and detokenizer) with a handler of its own. Each sends
# itself a SIGTERM and says whether it went on.
SGLANG_LIKE = """
import asyncio, multiprocessing, os, signal, sys

def checkpoint():  # a call: Python runs a pending signal's handler before it
    pass

def child(q):
    signal.signal(signal.SIGTERM, lambda *_: os._exit(3))
    os.kill(os.getpid(), signal.SIGTERM)
    checkpoint()
    q.put("child held")

async def main():
    loop, usr1 = asyncio.get_running_loop(), asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, lambda: os._exit(4))
    loop.add_signal_handler(signal.SIGUSR1, usr1.set)  # handled after SIGTERM's, in arrival order
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.wait_for(usr1.wait(), 60)
    print("loop held", flush=True)

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: os._exit(5))
    os.kill(os.getpid(), signal.SIGTERM)
    checkpoint()
    print("handler held", flush=True)
    asyncio.run(main())
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(q.get(timeout=60), flush=True)
    p.join(60)
    sys.exit(p.exitcode)
"""


def _sglang_like(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "sglang_like.py"
    script.write_text(SGLANG_LIKE)
    return subprocess.run(
        [sys.executable, str(script)], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_sglang_is_started_with_the_bootstrap_that_holds_sigterm() -> None:
    sup = ServerSupervisor(SGLangServerConfig(model_path="m", device="cpu"))
    env = sup.spawn_env()
    assert env["RLACTORS_HOLD_SIGTERM"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(HOLD_SIGTERM_BOOT)
    assert str(SGLANG_CPU_SHIM) in env["PYTHONPATH"].split(os.pathsep)


def test_the_bootstrap_keeps_sigterm_from_every_handler_and_spawned_process(tmp_path: Path) -> None:
    held = _sglang_like(tmp_path, {"PYTHONPATH": str(HOLD_SIGTERM_BOOT), "RLACTORS_HOLD_SIGTERM": "1"})
    assert held.returncode == 0, held.stdout + held.stderr
    assert held.stdout.split("\n")[:3] == ["handler held", "loop held", "child held"], held.stderr
    # without its variable it does nothing: the script's own handler acts
    plain = _sglang_like(tmp_path, {"PYTHONPATH": str(HOLD_SIGTERM_BOOT), "RLACTORS_HOLD_SIGTERM": ""})
    assert plain.returncode == 5 and plain.stdout == "", plain.stdout + plain.stderr


def test_the_bootstrap_runs_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import sys; sys.theirs_ran = True\n")
    path = os.pathsep.join([str(HOLD_SIGTERM_BOOT), str(theirs)])
    out = subprocess.run(
        [sys.executable, "-c", "import sys; print(getattr(sys, 'theirs_ran', False))"],
        env={**os.environ, "PYTHONPATH": path, "RLACTORS_HOLD_SIGTERM": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "True", out.stderr
