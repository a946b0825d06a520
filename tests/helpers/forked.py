"""Python processes a test starts, forked from fork servers the test process starts.

A test that runs ``python SCRIPT ...`` or ``python -m MODULE ...`` (a recipe driver, trainer ranks,
a reference server) pays for importing torch and transformers in every process, as a node agent's
workers did before they were forked (:mod:`rlactors.node.forkserver`). Here the test process starts a
fork server at its first such call, which imports what the commands name in ``preload`` once, and
each command is forked from it: what the child sees is what exec would have given it (the fork
server's tests check that field by field). A child can have only some variables of its own (ranks,
``RLACTORS_*``, ...), so a command whose environment differs in another (a test changed the
process's, or gives the command its own) gets a fork server started in that environment, up to
:data:`MAX_SERVERS`. Where no server would fork (a command that is not this interpreter's, a fifth
environment, a server that started a thread or is gone), the command is exec'd with :mod:`subprocess`.

:func:`run` is :func:`subprocess.run` with ``capture_output=True, text=True``; :func:`popen` a
:class:`subprocess.Popen` for the calls tests make of one (``pid``, ``poll``, ``wait``, signals,
``stdout`` as a file when piped). The children belong to this process: its connection to the
server closing (the process ending, however) kills those still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from rlactors.node.forkserver import SAFE_ENV, SAFE_ENV_PREFIXES, ForkedProcess, ForkServer

REPO = Path(__file__).resolve().parents[2]
# What the commands tests fork import before their first line: the trainer rank's modules (torch,
# transformers' model classes), the recipe driver's, the reference server's.
TRAINER = ("nodes.trainer.rank",)
DRIVER = ("recipes.gsm8k_grpo", "transformers.models.auto.tokenization_auto")
SERVER = ("nodes.inference.server",)

# Fork servers kept at once: one per environment the commands run with (beyond the variables a child
# may have of its own); a command in yet another environment is exec'd.
MAX_SERVERS = 4

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}


def _fixed(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a forked child cannot have of its own: the fork server's must be the same."""
    return tuple(
        sorted((k, v) for k, v in env.items() if k not in SAFE_ENV and not k.startswith(SAFE_ENV_PREFIXES))
    )


def _start(env: dict[str, str]) -> tuple[asyncio.AbstractEventLoop, ForkServer] | None:
    """The fork server started in ``env`` (at the first command in that environment: a test may
    change the process's environment, or give a command its own), connected on an event loop of
    this process's own (a thread); None past :data:`MAX_SERVERS`. It dies with this process."""
    global _loop
    key = _fixed(env)
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="tests-forkserver", daemon=True).start()
        if key not in _servers:
            if len(_servers) >= MAX_SERVERS:
                return None
            path = os.path.join(tempfile.mkdtemp(prefix="rlactors-tests-"), "fork.sock")
            _servers[key] = asyncio.run_coroutine_threadsafe(ForkServer.start(path, env=env), _loop).result()
        return _loop, _servers[key]


def _target(args: Sequence[str]) -> tuple[str, list[str], bool] | None:
    """(target, argv, script) of ``python SCRIPT ...`` or ``python -m MODULE ...`` run by this
    interpreter; None for any other command."""
    args = [str(a) for a in args]
    if len(args) < 2 or args[0] != sys.executable or (args[1] == "-m" and len(args) < 3):
        return None
    if args[1] == "-m":
        return args[2], args[3:], False
    if args[1].startswith("-"):
        return None
    return args[1], args[2:], True


class ForkedPopen:
    """A forked child, used as the :class:`subprocess.Popen` it replaces."""

    def __init__(self, args: Sequence[str], proc: ForkedProcess, loop: asyncio.AbstractEventLoop) -> None:
        self.args = list(args)
        self.pid = proc.pid
        self.stdout: IO[Any] | None = None
        self._proc = proc
        self._loop = loop

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def poll(self) -> int | None:
        return self._proc.returncode

    def wait(self, timeout: float | None = None) -> int:
        future = asyncio.run_coroutine_threadsafe(self._proc.wait(), self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()  # the wait is shielded: the child's exit is still recorded
            raise subprocess.TimeoutExpired(self.args, timeout or 0) from None

    def communicate(self, timeout: float | None = None) -> tuple[Any, None]:
        """The rest of a piped stdout (None if not piped) and the exit, within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        rest: list[Any] = []
        if self.stdout is not None:
            stdout = self.stdout
            reader = threading.Thread(target=lambda: rest.append(stdout.read()), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return (rest[0] if rest else None), None

    def send_signal(self, sig: int) -> None:
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# what :func:`popen` returns
Process = ForkedPopen | subprocess.Popen[Any]


def popen(
    args: Sequence[str],
    *,
    preload: Sequence[str] = (),
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    start_new_session: bool = False,
) -> Process:
    """Start ``args`` as :class:`subprocess.Popen` would (``stdout``/``stderr``: None, a file,
    ``subprocess.PIPE`` for ``stdout``, ``subprocess.STDOUT`` for ``stderr``); forked when it can be
    (a piped ``stderr`` is exec'd)."""
    env = dict(os.environ if env is None else env)
    target = _target(args)
    if target is not None and stderr != subprocess.PIPE:  # a piped stderr: exec
        started = _start(env)
        if started is not None and started[1].can_fork(env):
            loop, client = started
            proc = _fork(
                loop, client, args, target, preload, cwd, env, stdout, stderr, text, start_new_session
            )
            if proc is not None:
                return proc
    return subprocess.Popen(
        list(args),
        cwd=cwd,
        env=env,
        stdout=stdout,
        stderr=stderr,
        text=text,
        start_new_session=start_new_session,
    )


def _fork(
    loop: asyncio.AbstractEventLoop,
    client: ForkServer,
    args: Sequence[str],
    target: tuple[str, list[str], bool],
    preload: Sequence[str],
    cwd: str | Path | None,
    env: dict[str, str],
    stdout: Any,
    stderr: Any,
    text: bool,
    session: bool,
) -> ForkedPopen | None:
    read_end = None
    if stdout == subprocess.PIPE:
        read_end, stdout = os.pipe()
    if stderr == subprocess.STDOUT:
        stderr = asyncio.subprocess.STDOUT
    module, argv, script = target
    try:
        spawned = asyncio.run_coroutine_threadsafe(
            client.spawn(
                module,
                argv,
                env=env,
                cwd=str(cwd or os.getcwd()),
                preload=preload,
                stdout=stdout,
                stderr=stderr,
                session=session,
                script=script,
            ),
            loop,
        ).result()
    except OSError:  # the server is gone: exec this one, and the later ones (the client says so)
        spawned = None
    finally:
        if read_end is not None:
            os.close(stdout)  # the child has its copy
    if spawned is None:
        if read_end is not None:
            os.close(read_end)
        return None
    proc = ForkedPopen(args, spawned, loop)
    if read_end is not None:
        proc.stdout = os.fdopen(read_end, "r" if text else "rb")
    return proc


def run(
    args: Sequence[str],
    *,
    preload: Sequence[str] = (),
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """:func:`subprocess.run` with ``capture_output=True, text=True``, forked when it can be;
    :class:`subprocess.TimeoutExpired` (the child killed) past ``timeout``."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = popen(args, preload=preload, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(list(args), code, read_back(out), read_back(err))


def read_back(file: IO[bytes]) -> str:
    """What a child wrote to ``file`` (a temporary file given as its output), as text."""
    file.seek(0)
    return file.read().decode(errors="replace")
