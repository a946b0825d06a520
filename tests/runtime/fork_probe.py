"""Run as ``python -m tests.runtime.fork_probe ARGS`` (or as a script, by its path) by
tests/runtime/test_forkserver.py, forked or exec'd: prints, as one JSON line, what a process can see of how it was started; then sleeps
(``RLACTORS_PROBE_SLEEP``) and exits with ``RLACTORS_PROBE_CODE``. With ``RLACTORS_PROBE_CHILD`` it
first starts a child of its own that sleeps (its pid is printed), to check that a group dies whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def blocked(sig: signal.Signals) -> bool:
    return sig in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def main() -> int:
    child = None
    if os.environ.get("RLACTORS_PROBE_CHILD"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid
    seen = {
        "argv": sys.argv[1:],
        "main": Path(sys.argv[0]).name,
        "cwd": os.getcwd(),
        "var": os.environ.get("RLACTORS_PROBE_VAR"),
        "big": len(os.environ.get("RLACTORS_PROBE_BIG", "")),
        "ppid": os.getppid(),
        "sid": os.getsid(0),
        "cmdline": Path(f"/proc/{os.getpid()}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip(),
        "stdin": sys.stdin.readline().strip(),
        "draw": float(np.random.random()),
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm_blocked": blocked(signal.SIGTERM),
        "on_path": os.environ.get("RLACTORS_PROBE_PATH", "") in sys.path,
        "path0": sys.path[0],
        "spec": __spec__.name if __spec__ is not None else None,
        "child": child,
    }
    print(json.dumps(seen), flush=True)
    time.sleep(float(os.environ.get("RLACTORS_PROBE_SLEEP", "0")))
    return int(os.environ.get("RLACTORS_PROBE_CODE", "0"))


if __name__ == "__main__":
    sys.exit(main())
