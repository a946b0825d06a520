"""The reference server serving a reward model (a ``*ForSequenceClassification`` checkpoint) as
SGLang 0.5.23 does: ``/classify`` answers each prompt's score, equal to a direct transformers
forward pass of the same tokens, one answer or a list in SGLang's shape; ``/generate`` on it is
refused, and so is ``/classify`` on a model that generates; bodies SGLang refuses are refused."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from nodes.inference.models import ensure_tiny_checkpoint
from tests.helpers.classifier import tiny_classifier
from tests.helpers.servers import reference_server

pytestmark = pytest.mark.timeout(300)

TEXTS = ["The answer is 5.", "I think it is six, because two and three make six", "no"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_classifier(tmp_path_factory.mktemp("reward-model"))


@pytest.fixture(scope="module")
def rm(classifier: Path) -> Iterator[httpx.Client]:
    with (
        reference_server(["--backend", "hf", "--model-path", str(classifier), "--num-threads", "1"]) as url,
        httpx.Client(base_url=url, timeout=60) as c,
    ):
        yield c


def direct_scores(classifier: Path, prompts: list[list[int]]) -> list[float]:
    """Each prompt's score by its own forward pass of the checkpoint through transformers."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(classifier), dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([p])).logits[0, 0]) for p in prompts]


def tokenize(classifier: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(classifier))
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_classify_scores_are_a_direct_forward_pass(rm: httpx.Client, classifier: Path) -> None:
    prompts = tokenize(classifier, TEXTS)
    want = direct_scores(classifier, prompts)
    assert len({round(w, 4) for w in want}) == len(want)  # the texts score apart

    one = rm.post("/classify", json={"text": TEXTS[1]})
    assert one.status_code == 200, one.text
    body = one.json()
    assert (
        isinstance(body, dict) and len(body["embedding"]) == 1
    )  # one prompt: one answer, num_labels numbers
    assert body["embedding"][0] == pytest.approx(want[1], abs=1e-4)
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["prompt_tokens"] == len(prompts[1]) and meta["weight_version"] == "default"

    batch = rm.post("/classify", json={"text": TEXTS, "rid": ["a", "b", "c"]})  # prompts of different lengths
    assert batch.status_code == 200, batch.text
    answers = batch.json()
    assert [a["meta_info"]["id"] for a in answers] == ["a", "b", "c"]
    assert [a["embedding"][0] for a in answers] == pytest.approx(want, abs=1e-4)

    ids = rm.post("/classify", json={"input_ids": prompts})  # token ids: the same scores
    assert [a["embedding"][0] for a in ids.json()] == pytest.approx(want, abs=1e-4)
    single_ids = rm.post("/classify", json={"input_ids": prompts[0]}).json()
    assert single_ids["embedding"][0] == pytest.approx(want[0], abs=1e-4)


def test_a_classifier_does_not_generate(rm: httpx.Client) -> None:
    r = rm.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "LlamaForSequenceClassification" in message and "/classify" in message
    assert rm.get("/model_info").json()["is_generation"] is False
    assert rm.get("/health").status_code == 200  # its probe classifies one token instead


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({}, "At least one of text, input_ids"),
        ({"text": "a", "input_ids": [1]}, "text and input_ids cannot be provided at the same time"),
        ({"text": []}, "text: the batch is empty"),
        ({"text": ["a", "b"], "rid": "r"}, "The rid should be a list"),
        ({"text": ["a", "b"], "rid": ["r", "r"]}, "Duplicate request IDs"),
        ({"input_ids": [[1, 2], []]}, r"input_ids\[1\]: the prompt is empty"),
        ({"input_ids": [1, 49152]}, "outside the vocabulary"),
        ({"text": "a", "image_data": "x.png"}, "unknown field `image_data`"),
        ({"text": 5}, "text"),
    ],
)
def test_classify_refuses_what_sglang_refuses(rm: httpx.Client, body: dict, why: str) -> None:
    r = rm.post("/classify", json=body)
    assert r.status_code == 400, r.text
    assert re.search(why, r.json()["error"]["message"]), r.text


def test_a_generator_does_not_classify() -> None:
    model = str(ensure_tiny_checkpoint())
    with reference_server(["--backend", "sim", "--model-path", model]) as url:
        r = httpx.post(f"{url}/classify", json={"text": "hello"}, timeout=60)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "not a sequence classifier" in message and "ForSequenceClassification" in message
