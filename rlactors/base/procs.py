"""How a runtime process ends: the signal a node agent stops its worker with, dying with one's
parent, and what a worker's exit code means. Shared by the head, the agent, the fork server and the
worker, none of which imports another for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

__all__ = ["STOP_SIGNAL", "die_with_parent", "exit_reason"]

# How an agent asks its worker to stop (its on_stop hook runs); SIGTERM and SIGINT are left to the
# driver (see rlactors.node.worker), and SIGUSR2 (SIGURG as a fallback) dumps a worker's stacks
# (rlactors.base.forensics).
STOP_SIGNAL = signal.SIGUSR1


def exit_reason(returncode: int) -> str:
    """What a worker process's return code means, in the words an ActorDiedError gives."""
    if returncode < 0:
        try:
            return f"worker process killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"worker process killed by signal {-returncode}"
    return f"worker process exited with code {returncode}"


def die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent ``parent`` ends (Linux's
    PR_SET_PDEATHSIG), and exit now if it has ended already (before the request was made)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
