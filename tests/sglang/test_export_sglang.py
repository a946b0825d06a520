"""Real SGLang 0.5.23 (CPU) serves a folder written by ``rlactors export``: a checkpoint of one
trained step, exported in fp32, loads into SGLang's own model loader, and its greedy tokens equal
transformers' on the same folder (and differ from the untrained base model's). The server is the
package's shared one (tests/sglang/conftest.py: ``exported_sglang``)."""

from __future__ import annotations

import pytest

from tests.sglang.conftest import ExportedServer
from tests.sglang.test_sglang_code import NEEDS_SGLANG
from tests.trainer.export_worker import PROMPTS
from tests.trainer.test_export import greedy_hf, greedy_served

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.timeout(900),  # the shared server's export and start-up on CPU (1-2 min, more when loaded)
    NEEDS_SGLANG,
]


def test_real_sglang_serves_an_exported_checkpoint_as_transformers_runs_it(
    exported_sglang: ExportedServer,
) -> None:
    served = exported_sglang
    want = [greedy_hf(served.model, p, 12) for p in PROMPTS]
    assert want != [greedy_hf(served.base, p, 12) for p in PROMPTS]  # the trained weights, not the base's
    assert [greedy_served(served.url, p, 12) for p in PROMPTS] == want
