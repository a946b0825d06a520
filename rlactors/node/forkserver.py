"""Fork server: start Python processes by forking one that has already imported their modules.

Importing torch and transformers costs a process several CPU-seconds; a trainer rank, a rollout
actor and an inference server each pay it again when exec'd. A node agent instead starts one fork
server (``python -m rlactors.node.forkserver``, a plain single-threaded process) the first time it
starts an actor of a package it knows to be heavy (:data:`PRELOADABLE`). The server imports the
actor's module once, then forks: each child runs with that import already done, shared
copy-on-write. A worker of the run's own packages then starts in milliseconds, not seconds.

A child is what an exec'd ``python -m MODULE ARGS`` (or ``python SCRIPT ARGS``) would have been, as
far as it can see: its environment, working directory, ``sys.argv``, ``sys.path`` (the working
directory or the script's folder first, then the entries of ``PYTHONPATH``), standard
streams (pipes or files its owner passes over the socket), default signal handlers, a fresh seed
for numpy's global generator, torch's thread count from its ``OMP_NUM_THREADS``, and a process
title (``ps``, ``/proc/PID/cmdline``) reading as its command line. It dies with the server
(``PR_SET_PDEATHSIG``), and the server dies with the agent. Three things differ: numpy's BLAS keeps
the thread count it read at the server's start; ``/proc/PID/cmdline`` is the command line as one
string, its arguments separated by spaces, not NULs (``ps`` and ``pgrep -f`` read it the same);
and ``/proc/PID/environ`` shows the server's environment (``os.environ`` is the child's).

The server forks only when that is safe and faithful; otherwise the caller is told to exec:

- a child whose environment differs from the server's in a variable read at import time (only
  :data:`SAFE_ENV` and ``OMP_NUM_THREADS``, applied with ``torch.set_num_threads``, may differ);
- a server that has started a thread or loaded the CUDA driver (an import that did either makes
  every later fork unsafe, so the server stops forking altogether).

Each connection is one owner: when it closes (its process ended, however), the children it started
and still running are killed, as a parent-death signal would have. Exit statuses come back over the
connection, as ``asyncio.subprocess.Process.returncode`` would read them (``-N``: killed by signal N).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import os
import selectors
import signal
import socket
import sys
import threading
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import structlog

from rlactors.base.procs import die_with_parent

__all__ = [
    "PIPE",
    "PRELOADABLE",
    "ForkServer",
    "ForkedProcess",
    "node_fork_server",
    "preloadable",
    "unsafe_env",
]

# Packages whose actor modules a node agent has its fork server import before forking: ours, which
# start no thread and open nothing at import. Another package's module is imported in the child, as
# with exec. ``RLACTORS_FORK_PACKAGES`` (comma-separated; empty: exec every worker) replaces the list.
PRELOADABLE = ("nodes", "protocols", "rlactors")

# Variables that may differ between the server and a child: read after start-up, never at import.
SAFE_ENV_PREFIXES = ("RLACTORS_", "MASTER_", "NCCL_", "GLOO_", "TORCH_NCCL_")
# PYTEST_CURRENT_TEST: pytest changes it in its own process at each phase of a test, so a cluster
# embedded in a test would otherwise exec every worker after the phase its fork server started in.
SAFE_ENV = frozenset(
    {
        "PYTHONUNBUFFERED",
        "PYTHONPATH",
        "CUDA_VISIBLE_DEVICES",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "OMP_NUM_THREADS",
        "PYTEST_CURRENT_TEST",
    }
)

log = structlog.get_logger("rlactors.node.forkserver")

_MAX_FDS = 3


def preloadable(module: str) -> bool:
    """Whether a node agent forks the workers of actor classes in ``module`` (see :data:`PRELOADABLE`)."""
    packages = os.environ.get("RLACTORS_FORK_PACKAGES")
    allowed = PRELOADABLE if packages is None else [p.strip() for p in packages.split(",") if p.strip()]
    return module.split(".", 1)[0] in allowed


def unsafe_env(base: dict[str, str], env: dict[str, str]) -> str | None:
    """A variable whose value in ``env`` keeps a child from being forked from a server running with
    ``base`` (None: none does)."""
    for key in sorted(base.keys() | env.keys()):
        if base.get(key) != env.get(key) and key not in SAFE_ENV and not key.startswith(SAFE_ENV_PREFIXES):
            return key
    return None


def _frame(obj: Any) -> bytes:
    """One message on the socket: msgpack, read back by a streaming ``msgpack.Unpacker``."""
    return msgpack.packb(obj)


def _noop(signum: int, frame: Any = None) -> None:
    """SIGTERM and SIGINT are the driver's (see rlactors.node.worker); a Python handler rather than
    SIG_IGN, which a child would keep across its own execs."""


def _unsafe_to_fork() -> str | None:
    """Why forking this process now would be unsafe (None: it is safe).

    Native threads a library starts at load are its own to handle across fork (OpenBLAS's pool,
    started by importing numpy, is stopped before a fork and restarted after); a Python thread, a
    ZeroMQ context (its I/O threads) or an initialised CUDA driver would be lost or broken in the child.
    """
    if threading.active_count() > 1:
        return "the fork server has started a thread"
    zmq = sys.modules.get("zmq")
    if zmq is not None and getattr(zmq.Context, "_instance", None) is not None:
        return "the fork server has made a ZeroMQ context"
    with open("/proc/self/maps") as f:
        if "libcuda.so" in f.read():
            return "the fork server has loaded the CUDA driver"
    return None


def _preload(modules: Sequence[str]) -> None:
    """Import ``modules``, and those each names in its ``FORK_PRELOAD`` (what its actor imports
    when it starts: torch, transformers' model classes). A module that fails to import is left to
    the child, which imports it again and reports the error as an exec'd process would."""
    for name in modules:
        if name in sys.modules:
            continue
        try:
            module = importlib.import_module(name)
        # a preload is an optimisation: a module that fails to import is exec'd later, as without one
        except Exception:
            continue
        _preload(getattr(module, "FORK_PRELOAD", ()))


# --- the server ------------------------------------------------------------------------------------


class _Server:
    def __init__(self, path: str, env: dict[str, str]) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the fd
        self.sel.register(self.wake_r, selectors.EVENT_READ, "child")
        self.buffers: dict[socket.socket, msgpack.Unpacker] = {}  # each connection's requests as they come
        self.fds: dict[socket.socket, list[int]] = {}  # and the fds that came with them
        self.owner: dict[int, socket.socket] = {}  # child pid -> its owner's connection
        self.session: set[int] = set()  # children that lead their own process group
        self.unsafe: str | None = None
        self.env = env
        self.pid = os.getpid()

    def serve(self) -> None:
        while True:
            for key, _ in self.sel.select():
                if key.data == "accept":
                    conn, _ = self.listener.accept()
                    self.buffers[conn], self.fds[conn] = msgpack.Unpacker(), []
                    self.sel.register(conn, selectors.EVENT_READ, "conn")
                elif key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake_r, 4096):
                            pass
                    self.reap()
                else:
                    self.read(key.fileobj)  # type: ignore[arg-type]

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.session.discard(pid)
            conn = self.owner.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(_frame({"exited": pid, "rc": os.waitstatus_to_exitcode(status)}))

    def read(self, conn: socket.socket) -> None:
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, 65536, _MAX_FDS)
        except OSError:
            data, fds = b"", []
        if not data:
            self.drop(conn)
            return
        # a request's fds come with its first bytes; the rest of it may come in later reads
        unpacker = self.buffers[conn]
        unpacker.feed(data)
        self.fds[conn] += fds
        for req in unpacker:
            mine, self.fds[conn] = self.fds[conn][: req["nfds"]], self.fds[conn][req["nfds"] :]
            try:
                reply = self.spawn(conn, req, mine)  # the child closes the fds it does not take
            finally:
                for fd in mine:
                    os.close(fd)
            conn.sendall(_frame(reply))

    def drop(self, conn: socket.socket) -> None:
        """An owner gone: its children still running go with it."""
        self.sel.unregister(conn)
        self.buffers.pop(conn, None)
        for fd in self.fds.pop(conn, []):
            os.close(fd)
        conn.close()
        for pid, owner in list(self.owner.items()):
            if owner is conn:
                del self.owner[pid]
                with contextlib.suppress(ProcessLookupError):
                    if pid in self.session:
                        os.killpg(pid, signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGKILL)

    def spawn(self, conn: socket.socket, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if self.unsafe is None:
            _preload(req.get("preload") or ())
            gc.freeze()  # what is imported stays shared: a child's collections never write to it
            self.unsafe = _unsafe_to_fork()
        if self.unsafe is not None:
            return {"error": self.unsafe, "fatal": True}
        key = unsafe_env(self.env, req["env"])
        if key is not None:
            return {"error": f"the child's {key} differs from the fork server's", "fatal": False}
        pid = os.fork()
        if pid == 0:
            self._child(req, fds)  # never returns
        self.owner[pid] = conn
        if req.get("session"):
            self.session.add(pid)
        return {"pid": pid}

    def _child(self, req: dict[str, Any], fds: list[int]) -> None:
        code = 1
        try:
            die_with_parent(self.pid)
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.sel.close()
            self.listener.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            for c, held in self.fds.items():
                c.close()
                for fd in held:
                    os.close(fd)
            if req.get("session"):
                os.setsid()
            if req.get("block"):
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.Signals(s) for s in req["block"]})
            for target, fd in enumerate(fds):
                os.dup2(fd, target)  # inheritable: a process the child starts shares its streams
            for fd in fds:
                if fd > 2:  # the received copies: a process the child starts must not hold them
                    os.close(fd)
            code = _run_child(req)
        except SystemExit as e:  # as the interpreter ends on it: sys.exit("message") prints it, exits 1
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        # the child's program, anything it raises: printed as Python would, then the exit
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):  # streams already closed by the program
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def _run_child(req: dict[str, Any]) -> int:
    import runpy

    target: str = req["target"]
    argv: list[str] = req["argv"]
    # first: setproctitle finds the memory it writes through the environment it started with
    _set_title(" ".join([req["python"], *([] if req.get("script") else ["-m"]), target, *argv]))
    env: dict[str, str] = req["env"]
    old_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS") != old_threads and "torch" in sys.modules and env.get("OMP_NUM_THREADS"):
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    if "rlactors.wire.transport" in sys.modules:  # the one module of ours that reads variables at import
        sys.modules["rlactors.wire.transport"].reload_from_env()
    if req.get("cwd"):
        os.chdir(req["cwd"])
    # sys.path as Python builds it: the working directory first (`-m`), or the script's folder with
    # links resolved; then PYTHONPATH's entries
    first = os.path.dirname(os.path.realpath(target)) if req.get("script") else os.getcwd()
    rest = sys.path[1:]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in rest]
    sys.path[:] = [first, *extra, *rest]
    if "numpy" in sys.modules:  # its global generator was seeded once, in the server
        sys.modules["numpy"].random.seed()
    sys.argv = [target, *argv]
    if req.get("script"):
        runpy.run_path(target, run_name="__main__")
        return 0
    # The module may be one the server imported (a worker's): it runs again as __main__, as it
    # would under exec, where runpy has nothing to warn of.
    warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
    runpy.run_module(target, run_name="__main__", alter_sys=True)
    return 0


def _set_title(title: str) -> None:
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.setproctitle(title)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    # the environment it started with, which children are compared with: an import may add to
    # os.environ (torch sets its inductor cache folder)
    env = dict(os.environ)
    path, parent = args[0], int(args[1])
    die_with_parent(parent)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _noop)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    importlib.import_module("rlactors.node.worker")  # what every worker imports
    server = _Server(path, env)
    print("ready", flush=True)
    os.dup2(2, 1)  # the owner reads no more of stdout: what the server prints goes to its stderr
    server.serve()


# --- the client ------------------------------------------------------------------------------------


class ForkedProcess:
    """A child of the fork server, read as :class:`asyncio.subprocess.Process` is: ``pid``,
    ``returncode``, :meth:`wait`, signals; ``stdin``/``stdout``/``stderr`` when piped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.stdin: Any = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None

    def _exited(self, rc: int) -> None:
        if self.returncode is None:
            self.returncode = rc
            self._done.set_result(rc)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


async def _writable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(sock, wake)
    try:
        await ready
    finally:
        loop.remove_writer(sock)


async def _pipe_reader(fd: int) -> asyncio.StreamReader:
    """A stream of what the child writes to the pipe whose read end is ``fd``."""
    reader = asyncio.StreamReader()
    protocol = asyncio.StreamReaderProtocol(reader)
    await asyncio.get_running_loop().connect_read_pipe(lambda: protocol, os.fdopen(fd, "rb", 0))
    return reader


class _Stdin:
    """The write end of a child's stdin pipe: a few bytes, written at once."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


PIPE = -1  # a stream to read (stdout, stderr) or write (stdin)


class ForkServer:
    """A connection to a fork server, started by this process (:meth:`start`) or by its node
    agent (:meth:`connect`, at the path the agent put in ``RLACTORS_FORKSERVER``)."""

    def __init__(self) -> None:
        self.path = ""
        self.pid = 0  # the server's
        self.env: dict[str, str] = {}
        self.disabled: str | None = None  # why it no longer forks
        self._proc: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._children: dict[int, ForkedProcess] = {}
        self._lock = asyncio.Lock()

    @classmethod
    async def start(
        cls, path: str | Path, python: str = sys.executable, env: dict[str, str] | None = None
    ) -> ForkServer:
        """Start a server listening at ``path`` (a Unix socket), in ``env`` (default: this
        process's environment), and connect to it."""
        self = cls()
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self._proc = await asyncio.create_subprocess_exec(
            python,
            "-m",
            "rlactors.node.forkserver",
            str(path),
            str(os.getpid()),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self._proc.stdout is not None
        line = await self._proc.stdout.readline()
        if line.strip() != b"ready":
            self._proc.kill()
            raise OSError(f"the fork server did not start (exit code {await self._proc.wait()})")
        self.pid = self._proc.pid
        await self._connect(str(path), env)
        return self

    @classmethod
    async def connect(cls, path: str, pid: int) -> ForkServer:
        """Connect to a running server (its children are this process's to own)."""
        self = cls()
        self.pid = pid
        await self._connect(path, dict(os.environ))
        return self

    async def _connect(self, path: str, env: dict[str, str]) -> None:
        self.path, self.env = path, env
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, path)
        self._sock = sock
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="forkserver-replies")

    def can_fork(self, env: dict[str, str]) -> bool:
        """Whether the server would fork a child with ``env`` (else exec it)."""
        if self.disabled is not None or self._sock is None:
            return False
        return unsafe_env(self.env, env) is None

    async def spawn(
        self,
        target: str,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str | None = None,
        preload: Sequence[str] = (),
        stdin: int | None = None,
        stdout: Any = None,
        stderr: Any = None,
        session: bool = False,
        block: Sequence[int] = (),
        python: str = sys.executable,
        script: bool = False,
    ) -> ForkedProcess | None:
        """Fork ``python -m target *argv`` (with ``script``: ``python target *argv``, ``target`` a
        file); None when the server would not (exec it instead).

        ``stdin``/``stdout``/``stderr``: :data:`PIPE`, a file (or fd) to write to, or None for
        /dev/null; ``stderr`` may also be ``asyncio.subprocess.STDOUT``."""
        if self.disabled is not None or self._sock is None:
            return None
        mine: list[int] = []  # fds this process keeps (the parent ends of pipes)
        theirs: list[int] = []  # fds the child gets, closed here once sent
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            if stdin == PIPE:
                r, w = os.pipe()
                theirs.append(r)
                mine.append(w)
            else:
                theirs.append(os.dup(devnull))
            reads: list[int | None] = []
            for stream in (stdout, stderr):
                if stream == PIPE:
                    r, w = os.pipe()
                    theirs.append(w)
                    reads.append(r)
                    mine.append(r)
                elif stream == asyncio.subprocess.STDOUT:
                    theirs.append(os.dup(theirs[1]))
                    reads.append(None)
                elif stream is None or stream == asyncio.subprocess.DEVNULL:
                    theirs.append(os.dup(devnull))
                    reads.append(None)
                else:
                    theirs.append(os.dup(stream if isinstance(stream, int) else stream.fileno()))
                    reads.append(None)
            req = {
                "target": target,
                "script": script,
                "argv": list(argv),
                "env": env,
                "cwd": cwd,
                "preload": list(preload),
                "session": session,
                "block": [int(s) for s in block],
                "python": python,
                "nfds": len(theirs),
            }
            async with self._lock:  # one request in flight: replies come back in order
                if self._sock is None:
                    raise OSError("the fork server is gone")  # while this call waited for the lock
                frame = _frame(req)
                try:  # the fds go with the first bytes; a full socket buffer takes the rest later
                    sent = socket.send_fds(self._sock, [frame], theirs)
                except BlockingIOError:
                    await _writable(self._sock)
                    sent = socket.send_fds(self._sock, [frame], theirs)
                await asyncio.get_running_loop().sock_sendall(self._sock, frame[sent:])
                reply = await self._replies.get()
        except BaseException:  # any exit closes our copies of the fds, then re-raises
            for fd in mine:
                os.close(fd)
            raise
        finally:
            os.close(devnull)
            for fd in theirs:
                os.close(fd)
        if "error" in reply:
            log.debug("forkserver_declines", why=reply["error"])
            for fd in mine:
                os.close(fd)
            if reply.get("fatal", True):
                self.disabled = reply["error"]
            return None
        proc = ForkedProcess(int(reply["pid"]))
        self._children[proc.pid] = proc
        if stdin == PIPE:
            proc.stdin = _Stdin(mine[0])
        if reads[0] is not None:
            proc.stdout = await _pipe_reader(reads[0])
        if reads[1] is not None:
            proc.stderr = await _pipe_reader(reads[1])
        return proc

    async def _read(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        unpacker = msgpack.Unpacker()
        try:
            while data := await loop.sock_recv(self._sock, 65536):
                unpacker.feed(data)
                for msg in unpacker:
                    if "exited" in msg:
                        child = self._children.pop(msg["exited"], None)
                        if child is not None:
                            child._exited(int(msg["rc"]))
                    else:
                        self._replies.put_nowait(msg)
        except OSError:
            pass
        self._gone()

    def _gone(self) -> None:
        """The server ended: so did its children (their parent-death signal is SIGKILL)."""
        self.disabled = self.disabled or "the fork server is gone"
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for child in self._children.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            child._exited(-signal.SIGKILL)
        self._children.clear()
        self._replies.put_nowait({"error": "the fork server is gone", "fatal": True})

    async def close(self) -> None:
        """Disconnect (the server kills the children still running) and stop a server we started."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self._proc.wait()


_node_servers: dict[asyncio.AbstractEventLoop, ForkServer | None] = {}


async def node_fork_server() -> ForkServer | None:
    """In a worker its node agent forked: a connection to that agent's fork server, made once per
    event loop (None elsewhere, or when it cannot be reached). What it forks is this process's:
    killed when this process ends."""
    path, pid = os.environ.get("RLACTORS_FORKSERVER"), os.environ.get("RLACTORS_FORKSERVER_PID")
    if not path or not pid:
        return None
    loop = asyncio.get_running_loop()
    if loop not in _node_servers:
        _node_servers[loop] = None  # one attempt per loop, also when concurrent callers race
        with contextlib.suppress(OSError):
            _node_servers[loop] = await ForkServer.connect(path, int(pid))
    return _node_servers[loop]


if __name__ == "__main__":
    main()
