"""Where the nodes keep what they build once and reuse: model checkpoints for tests and the CPU
recipe (nodes/inference/models.py), environments' Python environments (nodes/rollout/environments/pyenvs.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["building", "cache_root"]


def cache_root(cache_dir: Path | None = None) -> Path:
    """The checkpoint cache: ``cache_dir``, else ``$RLACTORS_CACHE``, else ``~/.cache/rlactors``."""
    if cache_dir is not None:
        root = Path(cache_dir)
    else:
        root = Path(os.environ.get("RLACTORS_CACHE") or Path.home() / ".cache" / "rlactors")
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def building(lock: Path) -> Iterator[None]:
    """Hold the exclusive lock on the file ``lock`` (made if missing): of two processes building
    the same thing into the cache, the second waits for the first and finds it built."""
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
