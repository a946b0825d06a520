"""Other processes from /proc: a process's descendants and command line, and waiting for one to
end (there is no event for another process's exit: polled)."""

from __future__ import annotations

import time
from pathlib import Path


def gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether ``pid`` has ended (no longer exists, or is a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)  # polling a pid: there is no event for another process's exit


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...) as /proc shows them now."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    """``pid``'s command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
