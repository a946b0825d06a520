"""Checkpoint integrity: a sha256 manifest per checkpoint folder and the ``latest`` pointer.

A checkpoint folder ends with ``manifest.json`` (every other file's sha256 and size), written
after the files it lists; loading checks the files against it, so a changed byte is an error
that names the file instead of weights that silently turn into inf a step later. ``latest``
(the step of the last complete checkpoint) is replaced atomically. No torch here: the recipe
checks a resume point before it starts anything, without paying for the import.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

__all__ = ["CheckpointError", "hash_files", "resume_point", "verify", "write_latest", "write_manifest"]

MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(Exception):
    """A checkpoint that cannot be used: missing, incomplete, or not what its manifest says."""


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_files(folder: Path, share: tuple[int, int] = (0, 1)) -> dict[str, dict[str, int | str]]:
    """``{name: {sha256, bytes}}`` of share ``i`` of ``n`` of the files in ``folder`` (sorted by
    name, every n-th from the i-th), so n ranks can hash one folder in parallel."""
    i, n = share
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)
    return {m: {"sha256": _sha256(folder / m), "bytes": (folder / m).stat().st_size} for m in names[i::n]}


def write_manifest(folder: Path, files: dict[str, dict[str, int | str]]) -> None:
    """Write ``folder/manifest.json``; call it after every file it lists is complete."""
    (folder / MANIFEST).write_text(json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True))


def verify(folder: str | Path, share: tuple[int, int] = (0, 1)) -> None:
    """Check share ``i`` of ``n`` of ``folder``'s files (see :func:`hash_files`) against its manifest;
    raise :class:`CheckpointError` naming the first file that is missing or differs."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist")
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {folder} has no {MANIFEST}: it is incomplete or from an older version "
            "that did not record checksums, so its files cannot be trusted; resume from another one"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder / MANIFEST} is unreadable ({type(e).__name__}: {e})") from None
    i, n = share
    for name in sorted(files)[i::n]:
        f, want = folder / name, files[name]
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing (listed in {MANIFEST})")
        if f.stat().st_size != want["bytes"] or _sha256(f) != want["sha256"]:
            raise CheckpointError(
                f"checkpoint file {f} does not match its sha256 in {MANIFEST}: the file changed after "
                "it was saved (disk or copy corruption); resume from an earlier checkpoint"
            )


def write_latest(root: str | Path, step: int) -> None:
    """Make ``root/latest`` say ``step``: written to a temporary file, synced, then renamed over
    the old one, so a crash leaves the old pointer or the new one, never an empty file."""
    root = Path(root)
    tmp = root / f"{LATEST}.tmp"
    try:
        with tmp.open("w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / LATEST)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(root, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resume_point(root: str | Path) -> tuple[int, Path]:
    """The step and folder that ``root/latest`` names, checked against its manifest, so that a bad
    resume point is an error before anything starts. Errors say which file and what to do."""
    root = Path(root)
    latest = root / LATEST
    steps = sorted(int(p.name[5:]) for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit())
    found = ", ".join(f"step-{s}" for s in steps) or "none"
    there = f"checkpoint folders in {root}: {found}"
    fix = "point it at one of those steps, or start without resuming"
    if not latest.is_file():
        raise CheckpointError(f"nothing to resume: {latest} does not exist ({there})")
    try:
        text = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {latest}: {e}") from None
    if not text.isdigit():
        raise CheckpointError(
            f"{latest} should hold the step of the last complete checkpoint, found {text!r} ({there}); {fix}"
        )
    path = root / f"step-{int(text)}"
    if not path.is_dir():
        raise CheckpointError(f"{latest} names step {int(text)}, but {path} does not exist ({there}); {fix}")
    verify(path)
    return int(text), path
