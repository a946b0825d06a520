"""Real SGLang 0.5.23 (CPU) and the reference server serve a reward model the same way: the tiny
LlamaForSequenceClassification (``num_labels = 1``) answers ``/classify`` with the same scores, in
the same shape, for one text, a batch of texts and a batch of token ids; and a model that generates
refuses ``/classify`` on both with 400.

The refusal runs on the package's shared SGLang server (a generator, no start-up of its own). The
comparison needs SGLang started on the classifier: its CPU engine takes minutes to start there
(far over the minute a test of this suite may spend on a server of its own), so it runs only when
asked, with ``RLACTORS_SGLANG_CLASSIFIER=1``. ``/generate`` on the classifier is not asked of
SGLang: its scheduler fails on it and the whole server exits (the reference server answers 400)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.classifier import tiny_classifier
from tests.helpers.servers import reference_server, serving, start_sglang_server
from tests.sglang.conftest import ExportedServer
from tests.sglang.test_sglang_code import NEEDS_SGLANG, SGLANG_PYTHON

pytestmark = [pytest.mark.sglang, pytest.mark.slow, NEEDS_SGLANG]

ASKED = os.environ.get("RLACTORS_SGLANG_CLASSIFIER") == "1"

BODIES: list[dict[str, Any]] = [
    {"text": "The answer is 5."},
    {"text": ["The answer is 5.", "I think it is six, because two and three make six", "no"]},
    {"input_ids": [[5, 6, 7], [8, 9], list(range(100, 140))]},
]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_classifier(tmp_path_factory.mktemp("reward-model"))


@pytest.fixture(scope="module")
def sglang_rm(classifier: Path) -> Iterator[str]:
    flags = ["--max-total-tokens", "65536", "--grammar-backend", "none"]
    yield from serving(start_sglang_server(SGLANG_PYTHON, str(classifier), flags, timeout_s=1800))


def scores(answer: Any) -> list[float]:
    return [a["embedding"][0] for a in (answer if isinstance(answer, list) else [answer])]


@pytest.mark.timeout(2400)
@pytest.mark.skipif(
    not ASKED,
    reason="starts SGLang's CPU engine on the classifier, which takes minutes (over this suite's budget "
    "for a server of its own): set RLACTORS_SGLANG_CLASSIFIER=1 to run it",
)
def test_classify_answers_as_sglang_does(sglang_rm: str, classifier: Path) -> None:
    with reference_server(["--backend", "hf", "--model-path", str(classifier), "--num-threads", "1"]) as ours:
        for body in BODIES:
            theirs_r = httpx.post(f"{sglang_rm}/classify", json=body, timeout=300)
            ours_r = httpx.post(f"{ours}/classify", json=body, timeout=300)
            assert theirs_r.status_code == ours_r.status_code == 200, (theirs_r.text, ours_r.text)
            theirs, mine = theirs_r.json(), ours_r.json()
            assert isinstance(theirs, list) == isinstance(mine, list)  # one answer, or a list for a batch
            assert scores(mine) == pytest.approx(scores(theirs), abs=1e-4)
            both = zip(
                theirs if isinstance(theirs, list) else [theirs],
                mine if isinstance(mine, list) else [mine],
                strict=True,
            )
            for t, m in both:
                assert set(m) <= set(t) and set(m["meta_info"]) <= set(t["meta_info"])
                for key in ("finish_reason", "prompt_tokens", "weight_version", "num_retractions"):
                    assert m["meta_info"][key] == t["meta_info"][key], key
        assert httpx.get(f"{ours}/model_info", timeout=60).json()["is_generation"] is False
    assert httpx.get(f"{sglang_rm}/model_info", timeout=60).json()["is_generation"] is False


@pytest.mark.timeout(1200)  # the shared server's start-up when this test runs alone
def test_a_generator_refuses_classify_on_sglang_too(exported_sglang: ExportedServer) -> None:
    r = httpx.post(f"{exported_sglang.url}/classify", json={"text": "hello"}, timeout=120)
    assert r.status_code == 400
    assert "not appear to be an embedding model" in r.json()["error"]["message"]
