"""Environments' own Python environments (nodes/rollout/environments/pyenvs.py): named by what they
hold, not by where a local package lies; kept while any process holds one; removed when unused for
``$RLACTORS_PYENV_KEEP_DAYS`` days, or left half made, once a new one is made."""

from __future__ import annotations

import fcntl
import hashlib
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodes.rollout.environments import pyenvs
from nodes.rollout.environments.pyenvs import READY, USED, ensure_pyenv, keep_days, prune_pyenvs

PACKAGE = Path(__file__).with_name("v1_sums")
DAY = 86400.0
HOLDER = (
    "import pathlib, sys\n"
    "from nodes.rollout.environments.pyenvs import hold_pyenv\n"
    "hold_pyenv(pathlib.Path(sys.argv[1]))\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)


def _env(root: Path, name: str, used_days_ago: float | None, ready: bool = True) -> Path:
    """A made environment (or a half-made one: ``ready`` False) last used that many days ago,
    under a hash-like name as ensure_pyenv gives them (:func:`_named` reads ``name`` back)."""
    where = root / _hashed(name)
    (where / "bin").mkdir(parents=True)
    (where / "bin" / "python").write_bytes(b"\0" * 4096)
    if ready:
        (where / READY).write_text("1.0\n")
    if used_days_ago is not None:
        (where / USED).touch()
        at = time.time() - used_days_ago * DAY
        for marker in (USED, READY):
            if (where / marker).exists():
                os.utime(where / marker, (at, at))
    return where


def _hashed(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def _named(paths: list[Path], *names: str) -> bool:
    """Whether ``paths`` are the environments ``_env`` made under ``names``."""
    return sorted(p.name for p in paths) == sorted(_hashed(n) for n in names)


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes holding environments (:func:`_hold`), ended after the test."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _taker(where: Path) -> subprocess.Popen[str]:
    """Another process that takes ``where`` (as an env server's actor does), prints "held" once it
    holds it, and lives on until killed."""
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(where)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )


def _hold(holders: list[subprocess.Popen[str]], where: Path) -> subprocess.Popen[str]:
    """A :func:`_taker` that holds ``where`` now."""
    p = _taker(where)
    holders.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_a_local_package_counts_by_its_content_not_where_it_lies(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "v1_sums", tmp_path / "b" / "v1_sums"
    for where in (a, b):
        shutil.copytree(PACKAGE, where, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    reqs = ["verifiers==0.4.0", "uv"]
    assert pyenvs._identity([*reqs, str(a)]) == pyenvs._identity([str(b), *reqs])
    (b / "rlactors_v1_sums" / "__init__.py").write_text("# edited\n", encoding="utf-8")
    assert pyenvs._identity([*reqs, str(a)]) != pyenvs._identity([*reqs, str(b)])
    assert pyenvs._identity([*reqs, str(a)]) != pyenvs._identity(["verifiers==0.3.1", "uv", str(a)])


def test_unused_environments_and_leftovers_go_and_held_or_recent_ones_stay(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    old = _env(tmp_path, "old", 20)
    recent = _env(tmp_path, "recent", 3)
    held = _env(tmp_path, "held", 30)
    never_marked = _env(tmp_path, "made-before-marks", None)  # READY's time counts
    os.utime(never_marked / READY, (time.time() - 40 * DAY,) * 2)
    leftover = _env(tmp_path, "leftover", None, ready=False)
    being_made = _env(tmp_path, "being-made", None, ready=False)
    holder = _hold(holders, held)
    with open(tmp_path / f"{being_made.name}.lock", "a") as making:  # as ensure_pyenv holds it while making
        fcntl.flock(making, fcntl.LOCK_EX)
        removed = prune_pyenvs(tmp_path, 14)
    assert _named(removed, "leftover", "made-before-marks", "old")
    assert not old.exists() and not leftover.exists() and not never_marked.exists()
    assert recent.exists() and held.exists() and being_made.exists()
    assert (held / READY).exists()

    holder.kill()  # the run that took it 30 days ago ends
    holder.wait()
    os.utime(held / USED, (time.time() - 30 * DAY,) * 2)
    assert _named(prune_pyenvs(tmp_path, 14), "being-made", "held")
    assert recent.exists() and (recent / READY).exists()
    assert prune_pyenvs(tmp_path, 0) == [] and recent.exists()  # 0 keeps all
    assert prune_pyenvs(tmp_path, 1) == [recent]


def test_taking_an_environment_waits_for_a_prune_that_is_removing_it(tmp_path: Path) -> None:
    where = _env(tmp_path, "env", 1)
    with open(tmp_path / f"{where.name}.use", "a") as pruning:  # as prune_pyenvs holds it while removing
        fcntl.flock(pruning, fcntl.LOCK_EX)
        taker = _taker(where)
        try:
            assert taker.stdout is not None
            ready, _, _ = select.select([taker.stdout], [], [], 2.0)
            assert not ready, "it took the environment while a prune held it"
            shutil.rmtree(where)
        finally:
            fcntl.flock(pruning, fcntl.LOCK_UN)
        try:
            assert taker.stdout.readline().strip() == "held"
        finally:
            taker.kill()
            taker.wait()
    assert not where.exists()  # taking it did not bring back a part of it: ensure_pyenv remakes it


def test_an_interpreter_not_made_here_is_left_alone(tmp_path: Path) -> None:
    """An env server's actor holds its interpreter's environment only if ensure_pyenv made it: a
    test's or a user's own virtual environment gets no lock file beside it."""
    from nodes.rollout.environments.pyenvs import hold_pyenv

    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    hold_pyenv(venv, made=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".venv"]
    made = _env(tmp_path, "made", 30)
    hold_pyenv(made, made=True)
    assert (tmp_path / f"{made.name}.use").exists() and (made / USED).stat().st_mtime > time.time() - 60
    assert prune_pyenvs(tmp_path, 1) == []  # this process holds one; the other is not an environment
    assert venv.is_dir() and made.is_dir()


def test_keep_days_reads_its_variable_and_refuses_nonsense(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLACTORS_PYENV_KEEP_DAYS", raising=False)
    assert keep_days() == 14
    monkeypatch.setenv("RLACTORS_PYENV_KEEP_DAYS", "0.5")
    assert keep_days() == 0.5
    for bad in ("two weeks", "-1", "nan"):
        monkeypatch.setenv("RLACTORS_PYENV_KEEP_DAYS", bad)
        with pytest.raises(ValueError, match="RLACTORS_PYENV_KEEP_DAYS"):
            keep_days()


@pytest.mark.timeout(300)
def test_making_an_environment_prunes_the_cache_and_holds_what_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real environment, made with uv from a package with no dependencies."""
    package = tmp_path / "tiny_pkg"
    (package / "tiny_pkg").mkdir(parents=True)
    (package / "tiny_pkg" / "__init__.py").write_text("ANSWER = 42\n")
    (package / "pyproject.toml").write_text(
        '[project]\nname = "tiny-pkg"\nversion = "0.1.0"\n'
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
    )
    monkeypatch.delenv("RLACTORS_PYENV_KEEP_DAYS", raising=False)
    root = tmp_path / "cache" / "pyenvs"
    stale = _env(root, "stale", 15)
    python = ensure_pyenv([str(package)], timeout_s=240, cache=tmp_path / "cache")
    done = subprocess.run(
        [str(python), "-c", "import tiny_pkg; print(tiny_pkg.ANSWER)"], capture_output=True, text=True
    )
    assert done.stdout.strip() == "42", done.stderr
    assert not stale.exists()
    made = python.parent.parent
    assert (made / READY).exists() and (made / USED).exists()
    # this process holds what it made: a prune that would remove any unused one leaves it
    os.utime(made / USED, (time.time() - 30 * DAY,) * 2)
    assert prune_pyenvs(root, 1) == [] and (made / READY).exists()
    # and a second call finds it, without making it again
    ready = (made / READY).read_text()
    assert ensure_pyenv([str(package)], cache=tmp_path / "cache") == python
    assert (made / READY).read_text() == ready
