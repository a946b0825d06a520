"""How a running cluster is found: the record `rlactors up` writes, and an embedded run's head
address and credential file on disk.

An embedded cluster (``rlactors.init()``) keeps its secret in the driver's memory, so no other
process could reach it. While it runs, it records itself in the state directory
(``$RLACTORS_STATE_DIR/runs/<session>/``, default ``~/.rlactors``), and, when its program names a
run folder (:meth:`rlactors.Cluster.record_run`), in that folder too: ``rlactors-run.json`` (the
address, the security mechanism, the driver's pid, host and command) beside ``rlactors-secret``
(mode 600, the control credential). Both are removed when the cluster shuts down; a record whose
driver is gone (SIGKILL) is ignored and removed by the next reader.

``rlactors status|stack|pool --run RUN_DIR`` read a run folder's record; with no flag they use the
cluster ``rlactors up`` started, else the only live embedded run (:func:`live_runs`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlactors.base.errors import ClusterError

__all__ = [
    "RECORD",
    "SECRET",
    "RunRecord",
    "live_runs",
    "read_run",
    "read_state",
    "resolve_connect",
    "runs_dir",
    "state_file",
    "write_run",
]

RECORD = "rlactors-run.json"
SECRET = "rlactors-secret"


def state_file() -> Path:
    """Where `rlactors up` records the running cluster (``$RLACTORS_STATE_DIR/cluster.json``)."""
    return Path(os.environ.get("RLACTORS_STATE_DIR", "~/.rlactors")).expanduser() / "cluster.json"


def read_state(path: Path) -> dict[str, Any]:
    """The record `rlactors up` wrote; ClusterError (naming the file and the way out) if unreadable."""
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        state, why = None, str(e)
    else:
        why = "not a JSON object"
    if not isinstance(state, dict):
        raise ClusterError(f"the cluster record {path} is unreadable ({why}); `rlactors down` removes it")
    return state


def resolve_connect(address: str | None, secret_file: str | None) -> tuple[str, str | None, str | None]:
    """Head address, secret file and security mechanism for ``connect()``: arguments, then env,
    then ``rlactors up``'s state."""
    addr = address or os.environ.get("RLACTORS_ADDRESS")
    secret = secret_file or os.environ.get("RLACTORS_SECRET_FILE")
    mechanism = None
    sf = state_file()
    if addr is None and sf.exists():
        state = read_state(sf)
        addr = state.get("address")
        secret = secret or state.get("secret_file")
        mechanism = state.get("security")
    if addr is None:
        raise ClusterError(
            "no cluster address: pass one to connect(), set RLACTORS_ADDRESS, or start a cluster with `rlactors up cluster.toml`"
        )
    if addr.startswith("tcp://") and not secret:
        raise ClusterError(
            f"connecting to {addr} needs the cluster's secret file (secret_file= or RLACTORS_SECRET_FILE)"
        )
    return addr, secret, mechanism


class NoSuchRun(ClusterError):
    """``--run`` names a folder with no live run in it (the CLI exits 2: bad input)."""


@dataclass
class RunRecord:
    """A recorded run: where its record lives and what it says."""

    folder: Path
    address: str
    security: str
    secret_file: str
    pid: int
    about: dict[str, Any]

    def remove(self) -> None:
        """Remove the record and the credential (the run is ending)."""
        for name in (RECORD, SECRET):
            with contextlib.suppress(OSError):
                (self.folder / name).unlink()

    def describe(self) -> str:
        """How a person finds the run: the flag that names it, and its driver."""
        where = f"--run {self.about['run_dir']}" if self.about.get("run_dir") else f"--run {self.folder}"
        return f"{where} (pid {self.pid} on {self.about.get('host')}: {self.about.get('cmd', '')})"


def runs_dir() -> Path:
    """Where embedded runs record themselves: ``$RLACTORS_STATE_DIR/runs``."""
    return state_file().parent / "runs"


def write_run(
    folder: Path,
    address: str,
    security: str,
    secret: bytes | None,
    secret_file: str | None,
    run_dir: str = "",
) -> RunRecord:
    """Record a live embedded cluster in ``folder``: the credential (``secret`` written to a mode-600
    file, or the ``secret_file`` it already has) and the record that points at it; ``run_dir``: the
    run folder it is also recorded in, if any."""
    folder.mkdir(parents=True, exist_ok=True)
    if secret is not None:
        path = folder / SECRET
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a record left by a run that was killed
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        secret_file = str(path)
    about = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "cmd": " ".join(sys.argv),
        "cwd": os.getcwd(),
        "started": time.time(),
        "run_dir": run_dir,
    }
    record = {"address": address, "security": security, "secret_file": secret_file or "", **about}
    tmp = folder / f".{RECORD}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, folder / RECORD)
    return RunRecord(folder, address, security, secret_file or "", os.getpid(), about)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _load(folder: Path) -> RunRecord | None:
    try:
        r = json.loads((folder / RECORD).read_text())
        return RunRecord(folder, r["address"], r["security"], r["secret_file"], int(r["pid"]), r)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_run(run_dir: str | os.PathLike[str]) -> RunRecord:
    """The live run recorded in ``run_dir`` (a run folder, or its ``rlactors-run.json``); NoSuchRun,
    one line naming what is wrong and what to do, when there is none."""
    folder = Path(run_dir).expanduser()
    if folder.name == RECORD:
        folder = folder.parent
    if not folder.is_dir():
        raise NoSuchRun(f"--run {run_dir}: no such folder; pass the run's folder (its run.out_dir)")
    record = _load(folder)
    if record is None:
        raise NoSuchRun(
            f"--run {run_dir}: no live run is recorded there (no readable {RECORD}): the run has ended, "
            "or it runs on an `rlactors up` cluster (leave out --run)"
        )
    if not _alive(record.pid):
        raise NoSuchRun(
            f"--run {run_dir}: the run recorded there has ended (its driver, pid {record.pid}, is gone)"
        )
    return record


def live_runs() -> list[RunRecord]:
    """The embedded runs recorded in the state directory whose drivers still run (records of
    drivers that are gone are removed)."""
    out = []
    root = runs_dir()
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        record = _load(folder)
        if record is not None and _alive(record.pid):
            out.append(record)
        elif record is not None or not any(folder.iterdir()):
            shutil.rmtree(folder, ignore_errors=True)
    return out
