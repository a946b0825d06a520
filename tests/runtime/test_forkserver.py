"""The fork server (rlactors.node.forkserver): a forked child sees what an exec'd one would; exit codes
and signals read as asyncio's do; children die with their owner and with the server; it declines
what it cannot fork faithfully or safely; a node agent forks the workers of the packages it preloads
and execs the others."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import rlactors
from rlactors.base.aio import wait_for
from rlactors.node.forkserver import PIPE, ForkedProcess, ForkServer
from tests.helpers.processes import gone
from tests.runtime.actors import Counter

ROOT = Path(__file__).resolve().parents[2]
PROBE = "tests.runtime.fork_probe"
NO_HANG = 60


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[ForkServer]:
    fs = await ForkServer.start(tmp_path / "f.sock")
    try:
        yield fs
    finally:
        await fs.close()


def probe_env(**extra: str) -> dict[str, str]:
    # PYTHONPATH: the repository, as the probe's working directory is elsewhere (and for exec)
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


async def seen(proc: Any) -> dict[str, Any]:
    line = await wait_for(proc.stdout.readline(), NO_HANG)
    assert line, "the probe printed nothing"
    return dict(json.loads(line))


@pytest.mark.parametrize("script", [False, True], ids=["module", "script"])
async def test_a_forked_child_sees_what_an_exec_would_give_it(
    server: ForkServer, tmp_path: Path, script: bool
) -> None:
    extra = tmp_path / "extra"
    extra.mkdir()
    env = probe_env(
        RLACTORS_PROBE_VAR="x",
        RLACTORS_PROBE_CODE="3",
        RLACTORS_PROBE_PATH=str(extra),
        # a request longer than one read of the server's: the fds come with its first part
        RLACTORS_PROBE_BIG="x" * 100_000,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(extra)]),
    )
    args = ["a", "b c"]
    # as a script: by a path through a link, which Python resolves for the script's folder on sys.path
    link = tmp_path / "probe.py"
    link.symlink_to(ROOT / "tests" / "runtime" / "fork_probe.py")
    target, how = (str(link), [str(link)]) if script else (PROBE, ["-m", PROBE])
    forked = await server.spawn(
        target, args, env=env, cwd=str(tmp_path), stdin=PIPE, stdout=PIPE, script=script
    )
    assert isinstance(forked, ForkedProcess)
    forked.stdin.write(b"secret\n")
    forked.stdin.close()
    execd = await asyncio.create_subprocess_exec(
        sys.executable, *how, *args, env=env, cwd=tmp_path, stdin=PIPE, stdout=PIPE
    )
    assert execd.stdin is not None
    execd.stdin.write(b"secret\n")
    execd.stdin.close()
    mine, theirs = await seen(forked), await seen(execd)
    assert mine["ppid"] == server.pid and theirs["ppid"] == os.getpid()
    assert mine["cmdline"] == theirs["cmdline"] == " ".join([sys.executable, *how, "a", "b c"])
    same = (
        "argv",
        "main",
        "path0",
        "spec",
        "cwd",
        "var",
        "stdin",
        "sigterm_default",
        "sigint_default",
        "sigterm_blocked",
        "on_path",
    )
    assert {k: mine[k] for k in same} == {k: theirs[k] for k in same}
    assert mine["argv"] == args and mine["stdin"] == "secret" and mine["on_path"] and mine["var"] == "x"
    assert mine["big"] == 100_000
    if script:
        assert mine["path0"] == str(ROOT / "tests" / "runtime") and mine["spec"] is None
    else:
        assert mine["path0"] == str(tmp_path) and mine["spec"] == PROBE
    assert mine["sigterm_default"] and mine["sigint_default"] and not mine["sigterm_blocked"]
    assert await wait_for(forked.wait(), NO_HANG) == await wait_for(execd.wait(), NO_HANG) == 3
    assert forked.returncode == 3
    # numpy's global generator, seeded once in the server, is seeded again in each child
    other = await server.spawn(PROBE, [], env=env, stdout=PIPE)
    assert other is not None and (await seen(other))["draw"] != mine["draw"]
    await wait_for(other.wait(), NO_HANG)


async def test_a_killed_child_reads_as_killed_by_its_signal(server: ForkServer) -> None:
    proc = await server.spawn(PROBE, [], env=probe_env(RLACTORS_PROBE_SLEEP="600"), stdout=PIPE)
    assert proc is not None
    await seen(proc)
    proc.kill()
    assert await wait_for(proc.wait(), NO_HANG) == -signal.SIGKILL


async def test_an_owner_gone_takes_its_children_and_their_groups(server: ForkServer) -> None:
    owner = await ForkServer.connect(server.path, server.pid)
    env = probe_env(RLACTORS_PROBE_SLEEP="600", RLACTORS_PROBE_CHILD="1")
    proc = await owner.spawn(PROBE, [], env=env, stdout=PIPE, session=True, block=[signal.SIGTERM])
    assert proc is not None
    got = await seen(proc)
    assert got["sid"] == proc.pid and got["sigterm_blocked"]  # its own session, SIGTERM held
    os.kill(proc.pid, signal.SIGTERM)
    await asyncio.sleep(0.2)
    assert not gone(proc.pid, timeout=0)  # held, not acted on
    await owner.close()  # the owner's process ended, as far as the server can tell
    assert gone(proc.pid) and gone(got["child"])


async def test_children_die_with_the_server(server: ForkServer) -> None:
    proc = await server.spawn(PROBE, [], env=probe_env(RLACTORS_PROBE_SLEEP="600"), stdout=PIPE)
    assert proc is not None
    await seen(proc)
    os.kill(server.pid, signal.SIGKILL)
    assert await wait_for(proc.wait(), NO_HANG) == -signal.SIGKILL
    assert gone(proc.pid)
    assert await server.spawn(PROBE, [], env=probe_env()) is None  # exec from now on


async def test_a_variable_read_at_import_is_left_to_exec(server: ForkServer) -> None:
    env = probe_env(HF_HUB_OFFLINE="0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1")
    assert not server.can_fork(env)
    assert await server.spawn(PROBE, [], env=env) is None  # the server's own check agrees
    assert server.disabled is None
    proc = await server.spawn(PROBE, [], env=probe_env(), stdout=PIPE)  # it still forks the next
    assert proc is not None and (await seen(proc))["ppid"] == server.pid
    await wait_for(proc.wait(), NO_HANG)


async def test_a_thread_started_by_an_import_stops_the_forking(server: ForkServer) -> None:
    assert await server.spawn(PROBE, [], env=probe_env(), preload=["tests.runtime.fork_thread"]) is None
    assert server.disabled is not None and "thread" in server.disabled
    assert await server.spawn(PROBE, [], env=probe_env()) is None


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


async def test_a_node_agent_forks_the_workers_of_its_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLACTORS_FORK_PACKAGES", "tests")
    async with rlactors.init() as cluster:
        forked = await cluster.spawn(Counter, 5, name="forked")
        pid = await forked.pid()
        assert parent(pid) != os.getpid() and "rlactors.node.forkserver" in cmdline(parent(pid))
        assert "rlactors.node.worker forked" in cmdline(pid)
        assert await forked.add(1) == 6
        monkeypatch.setenv("RLACTORS_FORK_PACKAGES", "")
        execd = await cluster.spawn(Counter, name="execd")
        assert parent(await execd.pid()) == os.getpid()  # the agent runs in this process
        os.kill(pid, signal.SIGKILL)  # the server reports the exit; the agent the death
        with pytest.raises(rlactors.ActorDiedError, match="killed by SIGKILL"):
            await wait_for(forked.add(1), NO_HANG)
        assert await execd.add(2) == 2


def test_the_tests_fork_server_runs_what_subprocess_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/helpers/forked.py, which the tests' drivers, ranks and servers start through: the same
    result as :mod:`subprocess`, from a forked child; a timeout kills it."""
    from tests.helpers import forked

    def room(n: int) -> None:  # the tests this worker ran before may have started all it keeps
        monkeypatch.setattr(forked, "MAX_SERVERS", len(forked._servers) + n)

    script = str(ROOT / "tests" / "runtime" / "fork_probe.py")
    env = probe_env(RLACTORS_PROBE_CODE="4", RLACTORS_PROBE_VAR="v")
    room(1)
    for args in ([sys.executable, script, "x"], [sys.executable, "-m", PROBE, "x"]):
        got = forked.run(args, env=env, cwd=tmp_path, timeout=NO_HANG)
        want = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=NO_HANG)
        assert got.returncode == want.returncode == 4 and got.stderr == want.stderr == ""
        mine, theirs = json.loads(got.stdout), json.loads(want.stdout)
        assert "rlactors.node.forkserver" in cmdline(mine["ppid"])  # forked, not exec'd
        same = ("argv", "main", "path0", "spec", "cwd", "var", "cmdline")
        assert {k: mine[k] for k in same} == {k: theirs[k] for k in same}
    proc = forked.popen(
        [sys.executable, script],
        env=probe_env(RLACTORS_PROBE_SLEEP="600"),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert isinstance(proc, forked.ForkedPopen) and proc.stdout is not None
    assert json.loads(proc.stdout.readline())["sid"] == proc.pid
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.1)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(NO_HANG) == -signal.SIGTERM and proc.poll() == -signal.SIGTERM
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([sys.executable, script], env=probe_env(RLACTORS_PROBE_SLEEP="600"), timeout=0.5)
    # an environment that differs where a child cannot: a fork server of its own, started in it
    room(1)
    other = forked.run([sys.executable, script], env=probe_env(RLACTORS_PROBE_VAR="w", PROBE_OTHER="1"))
    seen_other = json.loads(other.stdout)
    assert seen_other["var"] == "w" and "rlactors.node.forkserver" in cmdline(seen_other["ppid"])
    assert seen_other["ppid"] != mine["ppid"]
    # yet another, with no room left: exec'd, as subprocess would
    room(0)
    third = forked.run([sys.executable, script], env=probe_env(RLACTORS_PROBE_VAR="x", PROBE_OTHER="2"))
    seen_third = json.loads(third.stdout)
    assert seen_third["var"] == "x" and seen_third["ppid"] == os.getpid()
