"""Checkpoint integrity: a sha256 manifest per checkpoint folder and the ``latest`` pointer.

A checkpoint folder ends with ``manifest.json`` (every other file's sha256 and size), written
after the files it lists; loading checks the files against it, so a changed byte is an error
that names the file instead of weights that silently turn into inf a step later. ``latest``
(the step of the last complete checkpoint) is replaced atomically. No torch here: the recipe
checks a resume point before it starts anything, without paying for the import.

A checkpoint of several ranks is one folder that every rank writes into, so rank 0 must see what
the others write: on hosts without a shared filesystem each rank would write to its own disk and
rank 0's manifest would list files that are elsewhere. Before anything is saved, each rank leaves a
marker holding the save's nonce in the folder (:func:`mark_visible`), and rank 0 checks that it
reads all of them (:func:`visibility_error`).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

__all__ = [
    "CheckpointError",
    "hash_files",
    "mark_visible",
    "resume_point",
    "saved_here",
    "unmark",
    "verify",
    "visibility_error",
    "write_latest",
    "write_manifest",
]

MANIFEST = "manifest.json"
LATEST = "latest"
STATE_FILE = "trainer_state.json"  # written by checkpoint.py; read here by saved_here
_MARKER = ".visible-rank{}"


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


def mark_visible(folder: Path, rank: int, nonce: str) -> str:
    """Leave rank ``rank``'s marker for the save ``nonce`` in ``folder`` (made by rank 0). Returns ""
    or why it could not; a rank that does not see the folder at all creates nothing."""
    if not folder.is_dir():
        return "it does not see the folder rank 0 created"
    try:
        (folder / _MARKER.format(rank)).write_text(nonce)
        return ""
    except OSError as e:
        return f"it cannot write there: {type(e).__name__}: {e}"


def unmark(folder: Path, rank: int) -> None:
    """Remove rank ``rank``'s marker, so it is not part of the checkpoint."""
    (folder / _MARKER.format(rank)).unlink(missing_ok=True)


def visibility_error(folder: Path, path: Path, nonce: str, hosts: list[str], failed: list[str]) -> str:
    """Rank 0's check after every rank ran :func:`mark_visible`: "" if it reads each rank's marker
    for ``nonce`` in ``folder``, else an error that names the checkpoint ``path`` and the hosts whose
    files rank 0 cannot see. ``hosts[r]``: where rank r runs; ``failed[r]``: its mark_visible result."""
    unseen = []
    for r, host in enumerate(hosts):
        marker = folder / _MARKER.format(r)
        try:
            seen = marker.read_text() == nonce
        except OSError:
            seen = False
        if failed[r]:
            unseen.append(f"rank {r} on {host} ({failed[r]})")
        elif not seen:
            unseen.append(f"rank {r} on {host}")
    if not unseen:
        return ""
    return (
        f"cannot save checkpoint {path}: rank 0 on {hosts[0]} does not see the files written to that "
        f"path by {'; '.join(unseen)}, so the checkpoint would be split across hosts and could not be "
        "resumed. Put the run's output folder "
        "(run.out_dir) on a filesystem that every trainer host mounts at the same path (NFS, Lustre, "
        "a shared volume). Nothing was saved; earlier checkpoints are kept"
    )


def saved_here(path: Path, save_id: str) -> None:
    """Check that this process sees checkpoint ``path`` as the ranks just saved it (``save_id`` in its
    data position) before ``latest`` is pointed at it: the driver that writes ``latest`` and resumes
    may run on another host than rank 0. CheckpointError otherwise."""
    try:
        seen = json.loads((path / STATE_FILE).read_text())["data_position"]["save_id"]
    except (OSError, ValueError, KeyError, TypeError):
        seen = None
    if seen != save_id:
        raise CheckpointError(
            f"checkpoint {path} was saved by the trainer ranks, but this process (on {socket.gethostname()}) "
            f"{'sees an older save there' if seen else 'does not see it'}: it runs on a host that does not "
            "share rank 0's filesystem, so --resume would not find it. Put the run's output folder "
            "(run.out_dir) on a filesystem that this host and every trainer host mount at the same path; "
            f"{LATEST} still names the previous checkpoint"
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
