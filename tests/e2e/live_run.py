"""A recipe run that a test drives while it runs: read its output up to a line, find its processes,
signal them, then wait for its end. Shared by the end-to-end tests that inject faults.

A run that stalls fails the test before pytest's timeout would, with its output, its logs and what
each of its processes was doing (``rlactors stack``): pytest's timeout kills it with nothing to go
on."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.cluster.test_cli import run_cli
from tests.helpers import forked
from tests.helpers.processes import cmdline, descendants

ROOT = Path(__file__).resolve().parents[2]
# How long a test waits for a run's next line: under pytest's 300 s, so that a stalled run fails
# with its stacks (a run's start-up here takes under a minute, a step seconds).
UNTIL_S = 240.0


def rlactors_stack(args: list[str], env: dict[str, str]) -> str:
    """``rlactors stack ARGS`` in ``env``: its output, or why there is none."""
    try:
        done = run_cli(["stack", *args], env, timeout=60)
    except subprocess.TimeoutExpired:
        return "rlactors stack did not answer within 60 s"
    return done.stdout[-12000:] + done.stderr[-2000:]


class Output:
    """A process's stdout, read by a thread of its own, so that :meth:`until` can give up on time.
    ``logs()`` and ``stacks()`` say what a failure message adds (a stall: both; an early end: the
    logs)."""

    def __init__(
        self,
        proc: forked.Process,
        logs: Callable[[], str] = str,
        stacks: Callable[[], str] = str,
    ) -> None:
        assert proc.stdout is not None
        self.proc, self.logs, self.stacks = proc, logs, stacks
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stdout: Any) -> None:
        for line in stdout:
            self._queue.put(line)
        self._queue.put(None)

    def until(self, prefix: str, timeout_s: float = UNTIL_S) -> str:
        """The next line that starts with ``prefix``; the run ending first, or no such line within
        ``timeout_s``, fails the test with its output, logs (and stacks)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(
                    f"the run ended before a line starting {prefix!r}:\n{self.text()[-3000:]}\n{self.logs()}"
                )
            self.lines.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(
            f"no line starting {prefix!r} within {timeout_s:g} s:\n{self.text()[-3000:]}\n{self.logs()}\n"
            f"--- rlactors stack:\n{self.stacks()}"
        )

    def rest(self, timeout_s: float) -> str:
        """Everything up to the process's exit (which must come within ``timeout_s``)."""
        self.proc.wait(timeout=timeout_s)
        self._thread.join(timeout=30)
        while not self._queue.empty():
            line = self._queue.get_nowait()
            self.lines.append(line or "")  # None: the end of stdout
        return self.text()

    def text(self) -> str:
        return "".join(self.lines)


class LiveRun:
    """``recipes/gsm8k_grpo.py`` with ``args``: stdout is read line by line (:meth:`until`), stderr
    goes to ``err_file`` (a pipe nobody reads could fill and block the run). As a context manager
    the run (its process group, with ``new_session``) is killed on the way out if it still runs."""

    def __init__(
        self, args: list[str], err_file: Path, env: dict[str, str] | None = None, new_session: bool = False
    ) -> None:
        self.err_file, self.new_session = err_file, new_session
        env = env or {**os.environ, "PYTHONPATH": str(ROOT)}
        with err_file.open("w") as stderr:
            self.proc = forked.popen(
                [sys.executable, str(ROOT / "recipes" / "gsm8k_grpo.py"), *args],
                preload=forked.DRIVER,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
                start_new_session=new_session,
            )
        # its stacks: the `rlactors up` cluster it runs on, else its own (embedded) run's folder
        out_dir = next((a.split("=", 1)[1] for a in args if a.startswith("run.out_dir=")), "")
        where = [] if "--cluster" in args or not out_dir else ["--run", out_dir]
        self.out = Output(
            self.proc, logs=lambda: self.stderr()[-3000:], stacks=lambda: rlactors_stack(where, env)
        )

    def __enter__(self) -> LiveRun:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self.proc.poll() is None:
            if self.new_session:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
            self.proc.wait()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def processes(self, needle: str) -> list[int]:
        """The run's processes whose command line holds ``needle``."""
        return [p for p in descendants(self.proc.pid) if needle in cmdline(p)]

    def until(self, marker: str, timeout_s: float = UNTIL_S) -> str:
        """The next line of stdout that starts with ``marker``. The run ending first, or no such
        line within ``timeout_s``, fails the test with its output, its stderr (and its stacks)."""
        return self.out.until(marker, timeout_s)

    def finish(self, timeout_s: float = 600) -> int:
        """Read the rest of stdout and wait for the run's exit; its exit code."""
        self.out.rest(timeout_s)
        return self.proc.returncode

    def output(self) -> str:
        return self.out.text()

    def stderr(self) -> str:
        return self.err_file.read_text()
