"""Real SGLang 0.5.23 (CPU) serves a folder written by ``rlactors export``: a checkpoint of one
trained step, exported in fp32, loads into SGLang's own model loader, and its greedy tokens equal
transformers' on the same folder (and differ from the untrained base model's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.trainer.export import export_checkpoint
from tests.helpers.servers import start_sglang_server, stop_server
from tests.sglang.test_sglang_code import NEEDS_SGLANG, SGLANG_PYTHON
from tests.trainer.export_worker import PROMPTS
from tests.trainer.launch import run_ranks
from tests.trainer.test_export import greedy_hf, greedy_served

HERE = Path(__file__).parent

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.timeout(900),  # one SGLang start-up on CPU (1-2 min, more on a loaded machine)
    NEEDS_SGLANG,
]


def test_real_sglang_serves_an_exported_checkpoint_as_transformers_runs_it(tmp_path: Path) -> None:
    base = ensure_tiny_checkpoint(tied=False)
    run_ranks(
        HERE.parent / "trainer" / "export_worker.py", ["full", str(tmp_path), str(base), str(base)], world=1
    )
    out = export_checkpoint(tmp_path / "full" / "checkpoints" / "step-1", tmp_path / "hf", dtype="fp32")
    want = [greedy_hf(out, p, 12) for p in PROMPTS]
    assert want != [greedy_hf(base, p, 12) for p in PROMPTS]  # the trained weights, not the base's
    proc, url = start_sglang_server(SGLANG_PYTHON, str(out))
    try:
        assert [greedy_served(url, p, 12) for p in PROMPTS] == want
    finally:
        stop_server(proc)
