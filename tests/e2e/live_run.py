"""A recipe run that a test drives while it runs: read its output up to a line, find its processes,
signal them, then wait for its end. Shared by the end-to-end tests that inject faults."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from tests.helpers import forked
from tests.helpers.processes import cmdline, descendants

ROOT = Path(__file__).resolve().parents[2]


class LiveRun:
    """``recipes/gsm8k_grpo.py`` with ``args``: stdout is read line by line (:meth:`until`), stderr
    goes to ``err_file`` (a pipe nobody reads could fill and block the run). As a context manager
    the run (its process group, with ``new_session``) is killed on the way out if it still runs."""

    def __init__(
        self, args: list[str], err_file: Path, env: dict[str, str] | None = None, new_session: bool = False
    ) -> None:
        self.err_file, self.new_session = err_file, new_session
        self.lines: list[str] = []
        with err_file.open("w") as stderr:
            self.proc = forked.popen(
                [sys.executable, str(ROOT / "recipes" / "gsm8k_grpo.py"), *args],
                preload=forked.DRIVER,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env or {**os.environ, "PYTHONPATH": str(ROOT)},
                start_new_session=new_session,
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

    def until(self, marker: str, timeout_s: float = 600) -> str:
        """Read stdout until a line starts with ``marker``; that line. The run ending first, or
        no such line within ``timeout_s``, fails the test with the output so far."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if line.startswith(marker):
                return line
        raise AssertionError(
            f"no line starting {marker!r}:\n{self.output()[-3000:]}\n{self.stderr()[-3000:]}"
        )

    def finish(self, timeout_s: float = 600) -> int:
        """Read the rest of stdout and wait for the run's exit; its exit code."""
        rest, _ = self.proc.communicate(timeout=timeout_s)
        self.lines.append(rest)
        return self.proc.returncode

    def output(self) -> str:
        return "".join(self.lines)

    def stderr(self) -> str:
        return self.err_file.read_text()
