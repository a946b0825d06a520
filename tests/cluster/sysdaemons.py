"""Real sshd and Slurm (munged + slurmctld + slurmd) daemons on this machine, for launcher tests.

Each context manager starts its daemons with private config, keys, sockets and state under a
temporary directory and loopback ports, waits until they answer, and stops every process it
started on exit. When a binary is missing or a daemon cannot start here, it calls
``pytest.skip`` with the reason and the daemon's log tail. ``scripts/ci-system-deps.sh``
installs the packages.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def which(name: str) -> str | None:
    """``shutil.which`` that also looks in the sbin folders a non-login PATH may lack."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def require(*names: str) -> dict[str, str]:
    """Absolute paths of ``names``; skips the test naming the ones that are not installed."""
    found = {n: which(n) for n in names}
    missing = [n for n, p in found.items() if p is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (run `bash scripts/ci-system-deps.sh` as root)")
    return {n: p for n, p in found.items() if p is not None}


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"(no log at {path})"


def wait_until(cond: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass; returns whether it held."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        # A zombie (exited, not yet reaped by its parent) counts as gone.
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def pids_with(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (a unique id chosen by the test)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if marker in cmd and pid_alive(int(d.name)):
                found.append(int(d.name))
    return found


def ancestors(pid: int) -> list[str]:
    """Command names of ``pid``'s parents, nearest first."""
    names = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        with contextlib.suppress(OSError):
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
    return names


def stop(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """SIGTERM ``proc``'s process group, then SIGKILL it if it has not exited in time."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout)


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )


@dataclass
class Sshd:
    """A running sshd on 127.0.0.1:``port`` that admits only ``client_key``."""

    port: int
    client_key: Path

    def ssh_options(self) -> list[str]:
        return [
            "-p",
            str(self.port),
            "-i",
            str(self.client_key),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
        ]


@contextlib.contextmanager
def sshd(tmp: Path) -> Iterator[Sshd]:
    """An sshd with a throwaway host key, accepting one throwaway client key, for this test only."""
    bins = require("sshd", "ssh", "ssh-keygen")
    tmp.mkdir(parents=True, exist_ok=True)
    for key in ("host_key", "client_key"):
        subprocess.run(
            [bins["ssh-keygen"], "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / key)],
            check=True,
            timeout=30,
        )
    (tmp / "authorized_keys").write_text((tmp / "client_key.pub").read_text())
    port = free_port()
    config = tmp / "sshd_config"
    config.write_text(
        f"""Port {port}
ListenAddress 127.0.0.1
HostKey {tmp}/host_key
AuthorizedKeysFile {tmp}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
PidFile {tmp}/sshd.pid
"""
    )
    # sshd refuses to start without its privilege-separation directory, which a machine
    # that never ran the sshd service (a container) does not have.
    with contextlib.suppress(OSError):
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    log = tmp / "sshd.log"
    proc = spawn([bins["sshd"], "-D", "-e", "-f", str(config)], log)
    try:

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        if not wait_until(lambda: proc.poll() is not None or listening(), 15) or proc.poll() is not None:
            pytest.skip(f"sshd could not start here:\n{tail(log)}")
        yield Sshd(port, tmp / "client_key")
    finally:
        stop(proc)


@dataclass
class Slurm:
    """A one-node Slurm cluster: its node name and the environment its clients need."""

    node: str
    env: dict[str, str]
    logs: Path

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)

    def allocate(self) -> str:
        """Grant a one-node allocation that outlives this call (like `salloc` before a shell); its job id."""
        res = self.run("salloc", "-N1", f"--nodelist={self.node}", "--no-shell", "--job-name=rlx-launch")
        job = res.stderr.split("Granted job allocation")[-1].split()[0] if "Granted" in res.stderr else ""
        assert res.returncode == 0 and job.isdigit(), f"salloc failed: {res.stderr}"
        return job

    def steps(self, job: str) -> list[str]:
        res = self.run("squeue", "--steps", "--noheader", f"--jobs={job}", "--format=%i %j")
        return [line for line in res.stdout.splitlines() if line.strip()]

    def jobs(self) -> list[str]:
        return self.run("squeue", "--noheader", "--format=%i").stdout.split()


@contextlib.contextmanager
def slurm(tmp: Path) -> Iterator[Slurm]:
    """munged + slurmctld + slurmd for a one-node cluster on this machine, all state under ``tmp``."""
    bins = require("munged", "slurmctld", "slurmd", "salloc", "srun", "sinfo", "squeue", "scancel")
    node = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(node)
    except OSError:
        pytest.skip(f"this host's name {node!r} does not resolve; agents bind to their node's host name")
    tmp.mkdir(parents=True, exist_ok=True)
    for d in ("state", "spool"):
        (tmp / d).mkdir(exist_ok=True)
    key = tmp / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    sock = tmp / "munge.sock"
    conf = tmp / "slurm.conf"
    conf.write_text(
        f"""ClusterName=rlx
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=rlx Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(conf)
    procs: list[subprocess.Popen[bytes]] = []
    cluster = Slurm(node, env, tmp)
    try:
        # --force: munged (run as root, with its key and socket in a temp dir) would otherwise refuse.
        munged = spawn(
            [
                bins["munged"],
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--log-file={tmp}/munged.log",
                f"--pid-file={tmp}/munged.pid",
                f"--seed-file={tmp}/munged.seed",
            ],
            tmp / "munged.out",
        )
        procs.append(munged)
        if (
            not wait_until(lambda: munged.poll() is not None or sock.exists(), 10)
            or munged.poll() is not None
        ):
            pytest.skip(
                f"munged could not start here:\n{tail(tmp / 'munged.log')}\n{tail(tmp / 'munged.out')}"
            )
        procs.append(spawn([bins["slurmctld"], "-D", "-i", "-f", str(conf)], tmp / "slurmctld.out", env))
        procs.append(spawn([bins["slurmd"], "-D", "-f", str(conf), "-N", node], tmp / "slurmd.out", env))

        def idle() -> bool:
            if any(p.poll() is not None for p in procs):
                return True
            try:
                out = cluster.run("sinfo", "--noheader", f"--nodes={node}", "--format=%t", timeout=10).stdout
            except subprocess.TimeoutExpired:
                return False
            return out.strip() == "idle"

        if not wait_until(idle, 30, 0.2) or any(p.poll() is not None for p in procs):
            pytest.skip(
                "slurmctld/slurmd could not start here (node never idle):\n"
                f"slurmctld: {tail(tmp / 'slurmctld.log')}\nslurmd: {tail(tmp / 'slurmd.log')}"
            )
        yield cluster
    finally:
        # Cancel every job of this private cluster first, so slurmd reaps its steps' processes.
        if len(procs) == 3 and procs[1].poll() is None:
            jobs = cluster.jobs()
            if jobs:
                cluster.run("scancel", *jobs)
                wait_until(lambda: not cluster.jobs(), 15, 0.2)
        for p in reversed(procs):
            stop(p)
