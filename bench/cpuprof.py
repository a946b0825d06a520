"""CPU seconds a command costs, with every process it starts: the measure of a test file's cost on a
CPU-bound CI machine (wall time moves with the machine's load; CPU time much less).

    python bench/cpuprof.py LOG COMMAND [ARGS...]
    python bench/cpuprof.py runs/pool.log .venv/bin/python -m pytest tests/e2e/test_pool.py -q
    python bench/cpuprof.py --json runs/suite-cpu.json runs/suite.log .venv/bin/python -m pytest -n 2

``--json FILE`` also writes every process seen: its command line, CPU seconds and parent pid.

The command's output goes to LOG. Every 0.3 s /proc is read: the CPU time (user + system) of each
process below this one, and of each process whose environment carries this run's marker (set here,
inherited by everything the command starts: the daemons ``rlactors up`` or Slurm start leave the
process tree but keep their environment). A process's last reading counts, so one that lives less
than 0.3 s is missed and one that ends between readings loses up to 0.3 s. Prints the exit code, the
CPU seconds (of the tree, and with the marked processes), the wall seconds and the costliest kinds
of process.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
import uuid

MARK = "RLACTORS_CPUPROF"
TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    dump = None
    if argv[0] == "--json":
        dump, argv = argv[1], argv[2:]
    log, cmd = argv[0], argv[1:]
    marker = uuid.uuid4().hex
    needle = f"{MARK}={marker}".encode()
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, MARK: marker})
    cpu: dict[int, float] = {}  # pid -> last CPU reading, for the tree and the marked processes
    tree: set[int] = set()
    names: dict[int, str] = {}
    parent: dict[int, int] = {}
    unmarked: set[int] = set()  # pids already read and not ours (an environment is read once)
    me = os.getpid()
    while True:
        done = proc.poll() is not None
        stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(p)) is not None}
        children: dict[int, list[int]] = collections.defaultdict(list)
        for pid, (ppid, _) in stats.items():
            children[ppid].append(pid)
        below, todo = set(), [me]
        while todo:
            for c in children.get(todo.pop(), []):
                below.add(c)
                todo.append(c)
        tree |= below
        for pid, (_, seconds) in stats.items():
            if pid == me or pid in unmarked:
                continue
            if pid not in below and pid not in cpu and needle not in _read(f"/proc/{pid}/environ"):
                unmarked.add(pid)
                continue
            cpu[pid] = max(seconds, cpu.get(pid, 0.0))
            parent.setdefault(pid, stats[pid][0])
            if pid not in names:
                names[pid] = " ".join(_read(f"/proc/{pid}/cmdline").decode(errors="replace").split("\0")[:4])[
                    :300
                ]
        if done:
            break
        time.sleep(0.3)
    in_tree = sum(s for p, s in cpu.items() if p in tree)
    total = sum(cpu.values())
    print(
        f"rc {proc.returncode} | CPU {in_tree:.1f} s in the process tree, {total:.1f} s with the marked "
        f"processes | wall {time.monotonic() - t0:.1f} s | {len(cpu)} processes"
    )
    if dump is not None:
        with open(dump, "w") as f:
            rows = [
                {"pid": p, "ppid": parent.get(p), "cpu_s": round(s, 2), "cmd": names.get(p, "?")}
                for p, s in sorted(cpu.items())
            ]
            json.dump(rows, f, indent=0)
    kinds: collections.Counter[str] = collections.Counter()
    for pid, seconds in cpu.items():
        kinds[names.get(pid, "?")[:100]] += seconds
    for name, seconds in kinds.most_common(8):
        print(f"  {seconds:7.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
