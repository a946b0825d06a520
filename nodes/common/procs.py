"""Processes a role starts and owns (servers of every kind): a free port, a child that is its
owner's to stop (:func:`child_setup`, :data:`HOLD_SIGTERM`), and how the owner stops its group.

Shared by the inference launcher (nodes/inference/launcher.py) and the rollout's environment
servers (nodes/rollout/environments/env_servers.py): neither role imports the other's files.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from rlactors.base.aio import wait_for

if TYPE_CHECKING:
    from rlactors.node.forkserver import ForkedProcess

__all__ = ["HOLD_SIGTERM", "STOP_SIGNAL", "child_setup", "free_port", "stop_process_group"]


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# How the owner stops a server: SIGINT (uvicorn, ours and SGLang's, shuts down on it as on SIGTERM),
# SIGKILL past a grace period. SIGTERM is a scheduler's, held back from the server (see child_setup).
STOP_SIGNAL = signal.SIGINT

# Runs the server's command with SIGTERM blocked. A blocked signal stays blocked across exec, and
# our server never unblocks it. SGLang does, in its main thread (Python's multiprocessing unblocks
# SIGTERM and SIGINT once it has started its resource tracker), and it installs handlers of its own,
# so SGLang is also started with HOLD_SIGTERM_BOOT, which keeps SIGTERM ignored in each of its
# processes. Blocked here, in the exec'd process, not in a preexec_fn: uvloop's spawn (libuv)
# empties the child's signal mask after the preexec_fn, just before it executes.
HOLD_SIGTERM = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); "
    "os.execvp(sys.argv[1], sys.argv[1:])",
]


def child_setup(owner: int) -> None:
    """In the server's process, before it executes: make it its owner's to stop.

    A scheduler's SIGTERM reaches every process of a job: a process group's (``timeout``,
    systemd, a launcher), or each process of every Slurm step (its cgroup). The owner's answer
    (finish the step, checkpoint, push, then stop its actors) needs the server alive, so:

    - its own session: a signal to the job's process group (or a terminal's Ctrl-C) does not
      reach it, and the owner's :data:`STOP_SIGNAL` to its group reaches every process it starts;
    - SIGTERM held: one sent to each of its processes (Slurm's way) is never acted on. Our server
      keeps it blocked (:data:`HOLD_SIGTERM`: pending); SGLang keeps it ignored in every process it
      starts (``nodes.inference.launcher.HOLD_SIGTERM_BOOT``: its own handlers are not installed). A SIGKILL still ends it;
    - the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG)``, Linux): SIGKILL when its
      owning worker dies (SGLang's own processes follow their parent the same way), so it never
      outlives its owner, however the owner ends.
    """
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != owner:  # the owner died before the death signal was armed
        os._exit(1)


async def stop_process_group(
    proc: asyncio.subprocess.Process | ForkedProcess, timeout_s: float = 10.0
) -> None:
    """Stop a server started with :func:`child_setup`: :data:`STOP_SIGNAL` to its process group,
    SIGKILL past ``timeout_s``; then SIGKILL to what is left of the group (a process of the
    server's that outlived it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, STOP_SIGNAL)
    try:
        await wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await wait_for(proc.wait(), timeout_s)
    with contextlib.suppress(ProcessLookupError):  # the group outlives its leader while a member lives
        os.killpg(proc.pid, signal.SIGKILL)
