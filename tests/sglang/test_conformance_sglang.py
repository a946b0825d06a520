"""The SGLang-protocol conformance suite (tests/conformance) against real SGLang 0.5.23 on CPU: every
test of it that asks the server under test passes against SGLang itself, so the reference server's
answers (what the same suite checks in the rest of the run) are SGLang's.

The server is the package's shared one (tests/sglang/conftest.py: ``exported_sglang``, started with
the flags the suite's own real-SGLang server has), so the suite runs here without an SGLang start-up
of its own: in a pytest of its own (its server fixture is chosen when its conftest is imported),
given the server's URL and the model it serves (``RLACTORS_CONFORMANCE_URL``/``_MODEL``/``_ALT_MODEL``).
tests/conformance/test_auth.py is not in it: it never asks the server under test and runs with real
SGLang in the main suite as it is. ``scripts/test-sglang.sh`` runs the same files against a server of
its own, by hand."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.sglang.conftest import CHANGES_IT, ExportedServer
from tests.sglang.test_sglang_code import NEEDS_SGLANG, REPO

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.timeout(2400),  # the shared server's start-up (alone), then the suite: 2-4 min on CPU
    getattr(pytest.mark, CHANGES_IT),  # its weight tests load other weights into the server
    NEEDS_SGLANG,
]

# the files of tests/conformance that ask the server under test (scripts/test-sglang.sh runs these)
FILES = [
    "test_generate.py",
    "test_abort_pause.py",
    "test_update_mid_generation.py",
    "test_weights.py",
    "test_validation.py",
    "test_stream.py",
    "test_logprobs.py",
    "test_penalties.py",
    "test_openai_endpoint.py",
]


def test_the_conformance_suite_passes_against_real_sglang(exported_sglang: ExportedServer) -> None:
    from nodes.inference.models import ensure_tiny_checkpoint

    served = exported_sglang
    alt = ensure_tiny_checkpoint(seed=1, tied=False)  # the served architecture, other weights
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RLACTORS_TEST_"))}
    env |= {
        "RLACTORS_CONFORMANCE_URL": served.url,
        "RLACTORS_CONFORMANCE_MODEL": str(served.model),
        "RLACTORS_CONFORMANCE_ALT_MODEL": str(alt),
    }
    files = [str(REPO / "tests" / "conformance" / f) for f in FILES]
    asked = served.log.read_text(errors="replace").count("POST /generate")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:] + served.log.read_text()[-2000:]
    assert re.search(r"\d+ passed", run.stdout), run.stdout[-3000:]
    # it asked this server (SGLang's log shows each request), not a reference server of its own
    assert served.log.read_text(errors="replace").count("POST /generate") > asked
