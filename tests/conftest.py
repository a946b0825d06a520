"""Shared fixtures. Every test that starts processes cleans them up."""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Keep torch (when a test imports it) to one thread per process on this small machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Each test process (each pytest-xdist worker) records clusters and embedded runs in its own state
# folder, never the user's ~/.rlactors: `rlactors status` with no flag finds "the only live run",
# which a run of a test beside it would otherwise make ambiguous. Tests that need their own set it.
_STATE_DIR = tempfile.mkdtemp(prefix="rlactors-test-state-")
os.environ["RLACTORS_STATE_DIR"] = _STATE_DIR

# pytest-timeout (and pytest's faulthandler_timeout) disarm their timers once a test has failed,
# so a teardown that then hangs (a task that will not cancel) would hold the whole run until CI's
# limit. Past this, every thread's stack goes to the real stderr and the run ends.
TEARDOWN_LIMIT_S = 240
_STDERR_FD: list[int] = []


def pytest_configure(config: pytest.Config) -> None:
    _STDERR_FD.append(os.dup(2))  # capture is suspended here: fd 2 is the terminal / CI log


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_STATE_DIR, ignore_errors=True)


# Test files run longest first. pytest-xdist's `--dist loadfile` otherwise starts the files with the
# most tests first, which leaves the long end-to-end files (one or two tests each, minutes each) for
# the end, on one worker while the other idles (.ci/run passes --no-loadscope-reorder so this order
# holds). tests/durations.json holds each file's seconds as a whole CI run measured them; a run with
# RLACTORS_TEST_DURATIONS=PATH writes its own there (.ci/run: runs/test-durations.json), to refresh it.
DURATIONS = ROOT / "tests" / "durations.json"
_SECONDS: dict[str, float] = {}


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _group(file: str) -> str:
    """A test file is one unit of work for `--dist loadfile` (.ci/run), so its module-scoped runs are
    shared; the real-SGLang files are one unit together: two SGLang start-ups at once on a 2-core
    machine have ended a server (SGLang killing itself) before its first step."""
    return "tests/sglang" if file.startswith("tests/sglang/") else file


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    group_seconds: dict[str, float] = {}
    for file, seconds in measured.items():
        group_seconds[_group(file)] = group_seconds.get(_group(file), 0.0) + seconds
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(_group(_file(item.nodeid)), i)
    rank = {id(item): i for i, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[float, int, int]:
        group = _group(_file(item.nodeid))
        return (-group_seconds.get(group, 0.0), first[group], rank[id(item)])

    items.sort(key=key)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadfile` with the real-SGLang files as one unit (see :func:`_group`)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(_file(nodeid))

    return Scheduling(config, log)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[_file(report.nodeid)] = _SECONDS.get(_file(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("RLACTORS_TEST_DURATIONS")
    if path and not hasattr(session.config, "workerinput"):  # the controller sees every worker's reports
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        ordered = sorted(_SECONDS.items(), key=lambda kv: -kv[1])
        Path(path).write_text(json.dumps({f: round(s) for f, s in ordered}, indent=1) + "\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    faulthandler.dump_traceback_later(TEARDOWN_LIMIT_S, exit=True, file=_STDERR_FD[0])
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
async def cluster() -> AsyncIterator[object]:
    """An embedded local cluster on the test's event loop."""
    import rlactors

    async with rlactors.init() as c:
        yield c
