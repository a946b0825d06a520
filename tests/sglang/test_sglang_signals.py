"""Real SGLang 0.5.23 (CPU) started by the launcher is its owner's to stop (issue 39): every one of
its processes is in the server's own session, so a signal to the job's process group (``timeout``,
systemd, a terminal) does not reach them; it serves, and its owner's stop ends every one of them.

(A SIGTERM sent to each of SGLang's processes, as Slurm's cgroup delivers it, is not held: Python's
multiprocessing unblocks SIGTERM in SGLang's main thread when it starts its resource tracker. The
reference server holds it: tests/conformance/test_launcher_signals.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from nodes.inference.launcher import ServerSupervisor, SGLangServerConfig
from nodes.inference.models import ensure_tiny_checkpoint
from tests.e2e.test_recipe import _descendants
from tests.helpers.processes import gone
from tests.sglang.test_sglang_code import NEEDS_SGLANG, SGLANG_PYTHON

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.timeout(1500),  # one SGLang start-up on CPU (2-4 min on a loaded 2-core machine)
    NEEDS_SGLANG,
]


async def test_sglang_runs_in_its_own_session_and_its_owners_stop_ends_every_process(tmp_path: Path) -> None:
    config = SGLangServerConfig(model_path=str(ensure_tiny_checkpoint()), python=SGLANG_PYTHON, device="cpu")
    log = tmp_path / "sglang.log"
    sup = ServerSupervisor(
        config, env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=1200, max_restarts=0, log_path=log
    )
    await sup.start()
    try:
        assert sup.proc is not None
        pids = [sup.proc.pid, *_descendants(sup.proc.pid)]
        assert len(pids) > 1, log.read_text()  # SGLang's scheduler and detokenizer beside its HTTP server
        assert {os.getsid(p) for p in pids} == {sup.proc.pid} != {os.getsid(0)}
        async with httpx.AsyncClient(timeout=300) as client:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
            r = await client.post(sup.url + "/generate", json=body)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
    finally:
        await sup.stop()
    assert all(gone(pid) for pid in pids), [p for p in pids if not gone(p, 0)]
