"""A full disk is one clear error, and never corrupts what was already written.

Every writer of a run's files (checkpoints, the export, metrics.jsonl, trace.json) goes through
this: it estimates what it will write and compares it with the free space first
(:func:`check_room`), and a write that still fails for space (``ENOSPC``, or torch's writers'
"unexpected pos" after a short write) becomes :class:`DiskFullError`, whose message is one line:
what was being written, the folder, the bytes needed and the bytes free. The writer removes what it
had written partly (:func:`append_whole` for appended files).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["DiskFullError", "append_whole", "check_room", "free_bytes", "full_line", "is_disk_full"]

_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(Exception):
    """A write did not fit on its disk (or would not have: checked before it began). One line:
    what, the folder, the bytes needed and free."""


def free_bytes(folder: str | Path) -> int:
    """Bytes free to this user at ``folder`` (its nearest existing parent)."""
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def full_line(what: str, folder: str | Path, need: int, free: int | None = None) -> str:
    """The one line of a full disk."""
    free = free_bytes(folder) if free is None else free
    return f"{what}: the disk is full at {folder}: it needs about {need:,} bytes, {free:,} are free"


def check_room(what: str, folder: str | Path, need: int) -> None:
    """Raise :class:`DiskFullError` when ``folder``'s disk has less than ``need`` bytes free."""
    free = free_bytes(folder)
    if free < need:
        raise DiskFullError(full_line(what, folder, need, free) + "; nothing was written")


def _causes(e: BaseException) -> list[BaseException]:
    """``e``, its causes and contexts, and the per-rank failures a torch.distributed.checkpoint
    ``CheckpointException`` carries."""
    seen: list[BaseException] = []
    todo = [e]
    while todo:
        x = todo.pop()
        if x is None or any(x is s for s in seen):
            continue
        seen.append(x)
        todo += [x.__cause__, x.__context__]  # type: ignore[list-item]
        failures: Any = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return seen


def is_disk_full(e: BaseException, folder: str | Path | None = None) -> bool:
    """Whether ``e`` (or what caused it) is a write that did not fit: ``ENOSPC``/``EDQUOT``, or, on
    a ``folder`` with under a MiB free, torch's zip writer's "unexpected pos" after a short write."""
    for x in _causes(e):
        if isinstance(x, OSError) and x.errno in _SPACE:
            return True
        text = str(x)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        if "unexpected pos" in text and folder is not None and free_bytes(folder) < 1 << 20:
            return True
    return False


def append_whole(f: BinaryIO, text: str, what: str) -> None:
    """Append ``text`` to ``f`` (opened ``"ab", buffering=0``) entirely or not at all: a write cut
    short by a full disk is taken back, and :class:`DiskFullError` raised, so the file ends with the
    last whole record."""
    data = memoryview(text.encode())
    start = f.seek(0, os.SEEK_END)
    try:
        while data:
            n = f.write(data)
            data = data[n or 0 :]
    except OSError as e:
        try:
            os.ftruncate(f.fileno(), start)
        except OSError:
            pass
        if is_disk_full(e):
            path = Path(getattr(f, "name", "?"))
            raise DiskFullError(
                full_line(what, path.parent, len(text.encode())) + f"; {path} kept as it was"
            ) from e
        raise
