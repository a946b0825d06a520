"""Waiting for another process to end (there is no event for another process's exit: polled)."""

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
