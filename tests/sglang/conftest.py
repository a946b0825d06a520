"""One real SGLang server (CPU) shared by the files of tests/sglang whose server arguments agree.

A start-up of SGLang on CPU costs 1-4 minutes, so the export test (SGLang serves a folder written by
``rlactors export``), the SGLang-protocol conformance suite (tests/conformance against real SGLang),
the pool test (a server the run did not start joins it) and the signal test (SGLang started by the
launcher holds a scheduler's SIGTERM) use one server: the launcher's
(:class:`~nodes.inference.launcher.ServerSupervisor`), on the exported folder, with the flags the
conformance suite needs. The tests that use the server run first in this package: those that only
read it, then those that load other weights into it for a while (each gives it the exported weights
back), then the signal test, which ends it (its owner's stop is what it checks).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from nodes.inference.launcher import ServerSupervisor, SGLangServerConfig

HERE = Path(__file__).parent

SHARED = "exported_sglang"  # the fixture's name
CHANGES_IT = "changes_shared_sglang"  # the mark of a test that loads other weights into it for a while
STOPS_IT = "stops_shared_sglang"  # the mark of a test that ends the shared server
# what the conformance suite starts real SGLang with (tests/conformance/conftest.py's server_url):
# at most 4 requests running, so a test can make one wait; no grammar backend, as the reference
# server has none; a KV pool bounded well above what its tests hold at once (4 requests of ~5,000
# tokens) instead of SGLang's share of the machine's memory, which costs seconds to allocate
CONFORMANCE_FLAGS = [
    "--max-running-requests",
    "4",
    "--grammar-backend",
    "none",
    "--max-total-tokens",
    "65536",
]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{CHANGES_IT}: loads other weights into the shared SGLang server (runs after its readers)"
    )
    config.addinivalue_line(
        "markers", f"{STOPS_IT}: ends the shared SGLang server (runs after its other users)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The shared server's users first among this package's tests (it is not held while the other
    files start servers of their own): its readers, then the tests that change its weights, then the
    one that stops it; otherwise in order."""

    def key(item: pytest.Item) -> int:
        if HERE not in Path(str(item.path)).parents:
            return 0
        if SHARED not in getattr(item, "fixturenames", ()):
            return 3
        if item.get_closest_marker(STOPS_IT):
            return 2
        return 1 if item.get_closest_marker(CHANGES_IT) else 0

    first = next((i for i, item in enumerate(items) if HERE in Path(str(item.path)).parents), None)
    if first is None:
        return
    ours = sorted((item for item in items if HERE in Path(str(item.path)).parents), key=key)
    rest = [item for item in items if HERE not in Path(str(item.path)).parents]
    items[:] = rest[:first] + ours + rest[first:]


@dataclass
class ExportedServer:
    """Real SGLang serving ``model``: one trained step of ``base``, exported in fp32."""

    sup: ServerSupervisor  # its owner
    url: str
    model: Path
    base: Path
    log: Path


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def exported_sglang(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ExportedServer]:
    """Real SGLang 0.5.23 on CPU, started by the launcher on a checkpoint exported by ``rlactors
    export`` with :data:`CONFORMANCE_FLAGS`; stopped at the end of the package (or by the test marked
    ``stops_shared_sglang``)."""
    from nodes.inference.models import ensure_tiny_checkpoint
    from nodes.trainer.export import export_checkpoint
    from tests.sglang.test_sglang_code import SGLANG_PYTHON
    from tests.trainer.launch import run_ranks

    tmp = tmp_path_factory.mktemp("exported-sglang")
    base = ensure_tiny_checkpoint(tied=False)
    worker = HERE.parent / "trainer" / "export_worker.py"
    await asyncio.to_thread(run_ranks, worker, ["full", str(tmp), str(base), str(base)], world=1)
    model = export_checkpoint(tmp / "full" / "checkpoints" / "step-1", tmp / "hf", dtype="fp32")
    config = SGLangServerConfig(
        model_path=str(model), python=SGLANG_PYTHON, device="cpu", extra_args=CONFORMANCE_FLAGS
    )
    log = tmp / "sglang.log"
    sup = ServerSupervisor(
        config, env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=1200, max_restarts=0, log_path=log
    )
    url = await sup.start()
    try:
        yield ExportedServer(sup, url, model, base, log)
    finally:
        await sup.stop()
