"""A Python-execution tool for agents: model-written code in a child process with a time limit, a
memory limit and no network, its output returned as text.

:func:`run_python` starts ``python -I`` (isolated: no user site, no environment paths) in a fresh
temporary folder, in its own process group, with ``RLIMIT_AS`` (memory), ``RLIMIT_CPU``,
``RLIMIT_FSIZE`` (no large files) and ``RLIMIT_NPROC`` limits, and kills the group when the wall
time runs out. Network: the child is moved into a network namespace of its own (no interfaces but
a down loopback) where the kernel allows it (as root, or with unprivileged user namespaces); else
the socket module is replaced before the code runs, which stops ordinary code but not code that
reaches libc through ``ctypes``: ``Result.network_isolated`` says which held. This is a tool for
training runs on machines you control, not a security boundary for hostile code.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from rlactors.base.aio import wait_for

__all__ = ["Result", "run_python"]

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
MAX_OUTPUT = 16_384  # characters of stdout and of stderr returned

# Runs in the child before the code: without a namespace of its own, no socket can be made.
_PRELUDE = """
import os, sys
if os.environ.get("SANDBOX_NO_NET_NS") == "1":
    import socket
    def _refuse(*a, **k):
        raise PermissionError("network access is disabled in this sandbox")
    socket.socket = socket.create_connection = socket.socketpair = socket.getaddrinfo = _refuse
    sys.modules["_socket"] = None
code = sys.stdin.read()
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


@dataclass
class Result:
    """What the code printed and how it ended."""

    stdout: str
    stderr: str
    returncode: int | None  # None: killed at the time limit
    timed_out: bool
    network_isolated: bool  # a network namespace of its own (else: sockets replaced in Python)

    def as_text(self) -> str:
        """The tool's answer for the model: the output, or the error."""
        if self.timed_out:
            return f"Error: the code ran past its time limit.\n{self.stdout}".strip()
        if self.returncode:
            tail = self.stderr.strip().splitlines()[-1:] or [f"exit status {self.returncode}"]
            return f"{self.stdout}Error: {tail[0]}".strip()
        return self.stdout.strip()


def _own_network() -> bool:
    """Unshare the network namespace (in the child, before exec); False if the kernel refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0:
        return True
    return libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0


def _limits(memory_mb: int, cpu_s: int) -> None:
    """The child's limits, set between fork and exec."""
    os.setsid()
    mem = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_NPROC, (256, 256))


_CHECK = (
    "import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
    f"sys.exit(0 if libc.unshare({CLONE_NEWNET}) == 0 or libc.unshare({CLONE_NEWUSER | CLONE_NEWNET}) == 0 else 1)"
)


def _can_unshare() -> bool:
    """Whether a child can get a network namespace of its own here (tried once, in a child)."""
    return subprocess.run([sys.executable, "-I", "-c", _CHECK], check=False, timeout=30).returncode == 0


_NETNS: bool | None = None


async def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512) -> Result:
    """Run ``code`` in a sandboxed ``python -I``; at most ``timeout_s`` of wall time (and of CPU)
    and ``memory_mb`` of address space."""
    global _NETNS
    if _NETNS is None:
        _NETNS = sys.platform.startswith("linux") and await asyncio.to_thread(_can_unshare)
    netns = _NETNS

    def setup() -> None:
        _limits(memory_mb, int(timeout_s) + 2)  # CPU: past the wall limit, which then fires first
        if netns:
            _own_network()

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SANDBOX_NO_NET_NS": "0" if netns else "1"}
    with tempfile.TemporaryDirectory(prefix="rlactors-tool-") as cwd:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-c",
            _PRELUDE,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cwd,
            env=env,
            preexec_fn=setup,
        )
        try:
            out, err = await wait_for(proc.communicate(code.encode()), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = await proc.communicate()
            return Result(_cut(out), _cut(err), None, True, netns)
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
    cpu_spent = proc.returncode == -signal.SIGXCPU  # its CPU limit: a time limit too
    return Result(_cut(out), _cut(err), None if cpu_spent else proc.returncode, cpu_spent, netns)


def _cut(data: bytes) -> str:
    text = data.decode(errors="replace")
    return text if len(text) <= MAX_OUTPUT else text[:MAX_OUTPUT] + "\n[output cut]"
