"""An environment's own Python environment: a virtual environment made with uv from a requirement
set, so that an environment's packages never meet the trainer's (verifiers 0.4 pins ``openai<3``;
the trainer's agents use openai 3).

Made once per requirement set under ``<cache>/pyenvs/<hash>`` (the cache is ``$RLACTORS_CACHE``,
else ``~/.cache/rlactors``: nodes/common/cache.py), so a second run finds it in a moment. A local
path among the requirements counts by its folder's name and its files' names and contents, not by
where it lies: editing the package makes a new environment, a second clone of it does not.

Each process that takes an environment holds a shared lock on ``<hash>.use`` until it exits and
marks the environment used. Making a new one removes those that no process holds and none has
used for ``$RLACTORS_PYENV_KEEP_DAYS`` days (default 14; 0 keeps all), and the leftovers of
attempts that died. uv reads no pip configuration, so the package sources pip is configured with
(find-links, index URLs, constraints: ``pip config list``) are passed to it, as scripts/setup.sh
does for the trainer's own environment (both ask scripts/install_sources.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import structlog

__all__ = ["ensure_pyenv", "hold_pyenv", "keep_days", "pip_source_flags", "prune_pyenvs", "uv_source_env"]

log = structlog.get_logger(__name__)

_DRAWING = "".join(map(chr, (0xD7, 0x2570, 0x2500, 0x25B6, 0x2502, 0x251C)))  # uv's report's marks
LAYOUT = 2  # how environments are made (2: bytecode compiled): a change makes new ones
READY = ".rlactors-ready"  # written last: an environment without it is incomplete
USED = ".rlactors-used"  # touched by each process that takes the environment
KEEP_DAYS = 14.0  # environments unused this long are removed (``$RLACTORS_PYENV_KEEP_DAYS``)
_held: dict[Path, int] = {}  # this process's shared locks on environments' ``.use`` files
SOURCES = Path(__file__).resolve().parents[3] / "scripts" / "install_sources.py"


def pip_source_flags() -> list[str]:
    """pip's package sources as uv's flags (``--find-links X``, ``--index-url X``, ...), as
    scripts/setup.sh passes them when it installs the trainer (scripts/install_sources.py chooses)."""
    done = subprocess.run(
        [sys.executable, str(SOURCES), "sources"], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise ValueError(f"{SOURCES} failed: {done.stderr.strip()[-300:]}")
    return [line for line in done.stdout.splitlines() if line]


def uv_source_env(flags: list[str]) -> dict[str, str]:
    """The same sources as uv's environment variables, for the uv that an environment's programs
    run themselves (verifiers prepares a harness's PEP 723 script with ``uv sync --script
    --no-config``, which reads these but no configuration file); no Python downloads; bytecode."""
    names = {
        "--find-links": "UV_FIND_LINKS",
        "--index-url": "UV_INDEX_URL",
        "--extra-index-url": "UV_EXTRA_INDEX_URL",
        "--constraint": "UV_CONSTRAINT",
    }
    env: dict[str, list[str]] = {}
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        env.setdefault(names[flag], []).append(value)
    out = {k: ("," if k == "UV_FIND_LINKS" else " ").join(v) for k, v in env.items()}  # as uv splits them
    # bytecode compiled at install: a harness's program starts once per episode
    return {
        **out,
        "UV_INDEX_STRATEGY": "unsafe-best-match",
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_COMPILE_BYTECODE": "1",
    }


def _identity(requirements: list[str]) -> str:
    """The hash naming a requirement set's environment (local paths by their files)."""
    h = hashlib.sha256(f"{sys.version_info[:2]} {LAYOUT}\n".encode())
    # a local path by its folder's name and content: where a clone lies does not matter
    keyed = sorted((f"path {Path(r).name}" if Path(r).exists() else r, r) for r in requirements)
    for key, req in keyed:
        h.update(key.encode() + b"\n")
        path = Path(req)
        if path.exists():
            files = (
                [path]
                if path.is_file()
                else sorted(p for p in path.rglob("*") if p.is_file() and not _built(p.relative_to(path)))
            )
            for p in files:  # by content: a fresh clone's files have new times, the same bytes
                h.update(f"{p.relative_to(path) if p != path else p.name}\n".encode() + p.read_bytes())
    return h.hexdigest()[:16]


def _built(rel: Path) -> bool:
    """A build's output inside a local package, not its source."""
    return any(part in ("build", "__pycache__", ".git") or part.endswith(".egg-info") for part in rel.parts)


def ensure_pyenv(requirements: list[str], timeout_s: float = 900.0, cache: Path | None = None) -> Path:
    """The interpreter of the environment holding ``requirements`` (pip requirement specs or local
    paths), made now unless it was made before. ``ValueError`` (one line: what failed to install)
    when uv cannot make it."""
    from nodes.common.cache import building, cache_root

    days = keep_days()  # a bad setting stops before the making
    reqs = [str(Path(r).resolve()) if _is_path(r) else r for r in requirements]
    root = cache_root(cache) / "pyenvs"
    root.mkdir(parents=True, exist_ok=True)
    where = root / _identity(reqs)
    python = where / "bin" / "python"
    hold_pyenv(where)  # before looking: a prune that holds it finishes first
    if (where / READY).exists():
        return python
    with building(root / f"{where.name}.lock"):  # two runs making it make it once
        if (where / READY).exists():
            return python
        shutil.rmtree(where, ignore_errors=True)  # an earlier attempt's leftovers
        log.info("pyenv_making", requirements=" ".join(requirements), path=str(where))
        uv = [sys.executable, "-m", "uv"]
        start = time.monotonic()
        _uv([*uv, "venv", "-q", "--python", sys.executable, str(where)], timeout_s, "create the environment")
        flags = pip_source_flags()
        # bytecode at install: its processes may run under PYTHONDONTWRITEBYTECODE, and every env
        # server, bridge and describe imports verifiers (compiling it from source each time)
        _uv(
            [
                *uv,
                "pip",
                "install",
                "-q",
                "--compile-bytecode",
                "--python",
                str(python),
                "--index-strategy",
                "unsafe-best-match",
                *flags,
                *reqs,
            ],
            timeout_s - (time.monotonic() - start),
            f"install {' '.join(requirements)}",
        )
        (where / "requirements.txt").write_text("\n".join(reqs) + "\n")
        (where / USED).touch()
        (where / READY).write_text(f"{time.monotonic() - start:.1f}\n")
        log.info("pyenv_made", path=str(where), seconds=round(time.monotonic() - start, 1))
    prune_pyenvs(root, days)
    return python


def keep_days() -> float:
    """How long an unused environment is kept: ``$RLACTORS_PYENV_KEEP_DAYS``, else 14 days."""
    raw = os.environ.get("RLACTORS_PYENV_KEEP_DAYS", "")
    try:
        days = float(raw) if raw else KEEP_DAYS
    except ValueError:
        raise ValueError(f"$RLACTORS_PYENV_KEEP_DAYS = {raw!r}: not a number of days") from None
    if not days >= 0:
        raise ValueError(f"$RLACTORS_PYENV_KEEP_DAYS = {raw!r}: must be 0 (keep all) or more")
    return days


def hold_pyenv(where: Path, made: bool = False) -> None:
    """Mark the environment at ``where`` in use by this process until it exits (a shared lock on
    ``<where>.use``: :func:`prune_pyenvs` leaves it) and used now. Once per process. ``made``:
    only if ``where`` is an environment :func:`ensure_pyenv` made (any other folder, such as the
    trainer's own virtual environment, is left alone)."""
    if where in _held or (made and not (where / READY).exists()):
        return
    fd = os.open(where.parent / f"{where.name}.use", os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits for a prune that is removing it
    _held[where] = fd
    if where.is_dir():
        (where / USED).touch()


def prune_pyenvs(root: Path, days: float) -> list[Path]:
    """Remove the environments under ``root`` that no process holds and none has used for ``days``
    days, and the leftovers of attempts that died (no process making them); what was removed.
    ``days`` 0 keeps all."""
    if days <= 0:
        return []
    removed, freed = [], 0
    cutoff = time.time() - days * 86400
    ours = re.compile(r"[0-9a-f]{16}")  # :func:`_identity`'s names: nothing else there is touched
    for where in sorted(p for p in root.iterdir() if p.is_dir() and ours.fullmatch(p.name)):
        ready = (where / READY).exists()
        if ready and _last_used(where) > cutoff:
            continue
        with _unheld(root / f"{where.name}.lock") as free, _unheld(root / f"{where.name}.use") as unused:
            if not (free and unused):
                continue  # being made, or in use
            size = _size(where)
            (where / READY).unlink(missing_ok=True)  # first: a removal cut short leaves leftovers
            shutil.rmtree(where, ignore_errors=True)
        removed.append(where)
        freed += size
    if removed:
        log.info(
            "pyenvs_pruned",
            removed=len(removed),
            freed_mib=round(freed / 2**20),
            unused_days=days,
            root=str(root),
        )
    return removed


def _last_used(where: Path) -> float:
    for name in (USED, READY):
        with contextlib.suppress(OSError):
            return (where / name).stat().st_mtime
    return 0.0


@contextlib.contextmanager
def _unheld(path: Path) -> Iterator[bool]:
    """Whether ``path``'s lock is free, holding it exclusively while so (a process taking the
    environment waits for this to end). Lock files stay: one unlinked under a waiting process
    would give it a lock that no one else sees."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _size(where: Path) -> int:
    """Bytes that removing ``where`` frees: its files linked nowhere else (uv links most of an
    environment's files from its own cache, which keeps them)."""
    total = 0
    for p in where.rglob("*"):
        with contextlib.suppress(OSError):
            st = p.lstat()
            if p.is_file() and not p.is_symlink() and st.st_nlink == 1:
                total += st.st_size
    return total


def _is_path(req: str) -> bool:
    return req.startswith((".", "/", "~")) or Path(req).exists()


def _uv(cmd: list[str], timeout_s: float, what: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        raise ValueError(f"could not {what}: uv ran past {timeout_s:.0f}s") from None
    if done.returncode != 0:
        # uv's report: its first line marked "error:" or a cross, then the cause beneath, tree-drawn
        lines = [ln.strip().lstrip(_DRAWING).strip() for ln in done.stderr.splitlines() if ln.strip()]
        lines = [ln for ln in lines if ln]
        first = next(
            (k for k, ln in enumerate(lines) if ln.startswith(("error:", "Because", "No solution"))), 0
        )
        detail = " ".join(lines[first : first + 3])
        raise ValueError(f"could not {what}: {detail[:400]}")
