"""The reward-model reward (``nodes.rollout.judge:reward_model``): the number a sequence classifier
gives, transformed, against a reference server serving a tiny random-weight
LlamaForSequenceClassification on ``/classify``: the score is a direct forward pass of the
conversation in the model tokenizer's chat template (or of a text template), completions scored
together go in one call, the cache answers a repeat, and a server that does not answer in time, or
not at all, scores ``default`` (counted) or drops the group."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from nodes.common.procs import free_port
from nodes.rollout import judge as judge_module
from nodes.rollout.judge import (
    JudgeDropError,
    JudgeParseError,
    RewardModel,
    RewardModelConfig,
    conversation,
    reward_model,
    transform_score,
)
from nodes.rollout.models import ModelClient, bind_model
from tests.helpers.classifier import tiny_classifier
from tests.helpers.servers import reference_server

ITEM = {"question": "What is 2 + 3?", "answer": "5"}
COMPLETIONS = ["It is 5.", "Two plus three makes six.", "5", "I do not know, maybe 7 or 8?"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_classifier(tmp_path_factory.mktemp("reward-model"))


@pytest.fixture(scope="module")
def rm_url(classifier: Path) -> Iterator[str]:
    with reference_server(["--backend", "hf", "--model-path", str(classifier), "--num-threads", "1"]) as url:
        yield url


@pytest.fixture
def counters() -> dict[str, float]:
    judge_module.COUNTERS.update(dict.fromkeys(judge_module.COUNTERS, 0))
    return judge_module.COUNTERS


def direct(classifier: Path, texts: list[str], chat: bool) -> list[float]:
    """Each text's (chat: each completion's conversation's) score by a forward pass of the
    checkpoint through transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(classifier))
    model = AutoModelForSequenceClassification.from_pretrained(str(classifier), dtype=torch.float32).eval()
    out = []
    for t in texts:
        text = tok.apply_chat_template(conversation(t, ITEM), tokenize=False) if chat else t
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    return out


async def scored(cfg: RewardModelConfig, urls: list[str], completions: list[str]) -> tuple[list[float], int]:
    """The completions' rewards, scored at once, and how many calls the client made."""
    client = ModelClient("rm", urls)
    try:
        rm = RewardModel(cfg, client)
        values = await asyncio.gather(*(rm.score(c, ITEM) for c in completions))
        return list(values), client.calls
    finally:
        await client.aclose()


@pytest.mark.timeout(300)
def test_scores_are_the_classifier_on_the_chat_template(
    rm_url: str, classifier: Path, counters: dict[str, float]
) -> None:
    """The default: the conversation in the chat template of the tokenizer its server reports."""
    cfg = RewardModelConfig(judge="rm", batch_size=8, batch_wait_s=0.05)
    values, calls = asyncio.run(scored(cfg, [rm_url], COMPLETIONS))
    want = direct(classifier, COMPLETIONS, chat=True)
    assert len({round(w, 4) for w in want}) == len(want)  # the completions score apart
    assert values == pytest.approx(want, abs=1e-4)
    assert calls == 1 and counters["judge_calls"] == 1  # the four in one /classify call
    assert counters["judge_errors"] == 0


@pytest.mark.timeout(300)
def test_text_template_sigmoid_and_the_cache(
    rm_url: str, classifier: Path, counters: dict[str, float]
) -> None:
    cfg = RewardModelConfig(
        judge="rm", template="Q: {prompt}\nA: {completion}", transform="sigmoid", batch_wait_s=0.05
    )
    texts = [f"Q: {ITEM['question']}\nA: {c}" for c in COMPLETIONS[:2]]
    want = [1 / (1 + math.exp(-x)) for x in direct(classifier, texts, chat=False)]

    async def run() -> tuple[list[float], list[float], int]:
        client = ModelClient("rm", [rm_url])
        try:
            rm = RewardModel(cfg, client)
            first = await asyncio.gather(*(rm.score(c, ITEM) for c in COMPLETIONS[:2]))
            again = await asyncio.gather(*(rm.score(c, ITEM) for c in COMPLETIONS[:2]))
            return list(first), list(again), client.calls
        finally:
            await client.aclose()

    first, again, calls = asyncio.run(run())
    assert first == pytest.approx(want, abs=1e-4)
    assert again == first and calls == 1  # answered by the cache
    assert counters["judge_cache_hits"] == 2


@pytest.mark.timeout(300)
def test_the_reward_function_finds_the_models_servers(rm_url: str, classifier: Path) -> None:
    """``reward_model`` as ``[reward] fn`` calls it: the model's servers are where it was told
    (``bind_model``, as the recipe's driver is), the tokenizer named by ``tokenizer``."""
    bind_model("rm-bound", [rm_url])
    cfg = RewardModelConfig(
        judge="rm-bound", tokenizer=str(classifier), transform="minmax", score_min=-1, score_max=1
    )
    value = asyncio.run(reward_model(COMPLETIONS[0], ITEM, cfg))
    raw = direct(classifier, COMPLETIONS[:1], chat=True)[0]
    assert value == pytest.approx(min(1.0, max(0.0, (raw + 1) / 2)), abs=1e-4)


@pytest.fixture
async def silent_url() -> AsyncIterator[str]:
    """A server that accepts connections and reads requests but never answers."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()  # until the client goes away

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for w in held:
            w.close()
        await server.wait_closed()


@pytest.mark.timeout(60)
async def test_a_server_that_does_not_answer_in_time_scores_the_default(
    silent_url: str, classifier: Path, counters: dict[str, float]
) -> None:
    cfg = RewardModelConfig(
        judge="rm", tokenizer=str(classifier), timeout_s=0.5, default=0.25, batch_wait_s=0.0
    )
    client = ModelClient("rm", [silent_url])
    try:
        rm = RewardModel(cfg, client)
        assert [await rm.score(c, ITEM) for c in COMPLETIONS[:2]] == [0.25, 0.25]
    finally:
        await client.aclose()
    assert (
        counters["judge_errors"] == 2 and counters["judge_calls"] == 2
    )  # each asked again: no failure cached


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_error", ["default", "drop"])
def test_a_dead_server_scores_the_default_or_drops(
    classifier: Path, counters: dict[str, float], on_error: Literal["default", "drop"]
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = RewardModelConfig(
        judge="rm",
        tokenizer=str(classifier),
        timeout_s=0.5,
        on_error=on_error,
        default=-1.0,
        batch_wait_s=0.0,
    )
    if on_error == "drop":
        # the client waits for a server to come back (a pool's replacement) until the timeout
        with pytest.raises(JudgeDropError, match=r"judge 'rm': (timeout|ModelCallError)"):
            asyncio.run(scored(cfg, [dead], COMPLETIONS[:1]))
    else:
        assert asyncio.run(scored(cfg, [dead], COMPLETIONS[:1]))[0] == [-1.0]
    assert counters["judge_errors"] == 1


def test_no_tokenizer_to_ask_for_is_a_counted_failure(counters: dict[str, float]) -> None:
    """The chat template needs the model's tokenizer: a server that cannot tell it fails the
    sample as any failure does, naming the key that fixes it."""
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = RewardModelConfig(judge="rm", timeout_s=0.5, on_error="drop", batch_wait_s=0.0)
    with pytest.raises(JudgeDropError, match=r"reward\.fn_args\.tokenizer"):
        asyncio.run(scored(cfg, [dead], COMPLETIONS[:1]))
    assert counters["judge_errors"] == 1 and counters["judge_calls"] == 0


def test_a_chat_template_that_fails_is_a_counted_failure(counters: dict[str, float]) -> None:
    class Refusing:  # a tokenizer whose template raises (as a jinja template's raise_exception does)
        chat_template = "..."

        def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
            raise RuntimeError("Conversation roles must alternate user/assistant/user/assistant/...")

    rm = RewardModel(RewardModelConfig(judge="rm", default=0.5), client=None)
    rm._tokenizer = Refusing()
    assert asyncio.run(rm.score("x", ITEM)) == 0.5
    assert counters["judge_errors"] == 1 and counters["judge_calls"] == 0


@pytest.mark.parametrize(
    ("cfg", "answer", "want"),
    [
        (RewardModelConfig(), {"embedding": [1.5]}, 1.5),
        (RewardModelConfig(transform="sigmoid"), {"embedding": [0.0]}, 0.5),
        (RewardModelConfig(transform="sigmoid"), {"embedding": [-1000.0]}, 0.0),
        (RewardModelConfig(transform="minmax", score_min=-2, score_max=2), {"embedding": [1.0]}, 0.75),
        (RewardModelConfig(transform="minmax", score_min=-2, score_max=2), {"embedding": [9.0]}, 1.0),
        (RewardModelConfig(label=1), {"embedding": [0.1, 0.9]}, 0.9),
    ],
)
def test_transforms(cfg: RewardModelConfig, answer: dict[str, Any], want: float) -> None:
    assert transform_score(answer, cfg) == pytest.approx(want)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ({"text": "7"}, "no output 0"),  # a generator's answer, not a classifier's
        ({"embedding": []}, "no output 0"),
        ({"embedding": [None]}, "not a finite number"),
        ({"embedding": [float("nan")]}, "not a finite number"),
    ],
)
def test_answers_without_a_score_are_refused(answer: dict[str, Any], why: str) -> None:
    with pytest.raises(JudgeParseError, match=why):
        transform_score(answer, RewardModelConfig())


def test_conversation_takes_the_items_messages_or_its_prompt() -> None:
    assert conversation("5", ITEM) == [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
    ]
    chat = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]}
    assert conversation("5", chat)[:2] == chat["prompt"] and conversation("5", chat)[2]["content"] == "5"


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="score_max"):
        RewardModelConfig(transform="minmax", score_min=1, score_max=1)
    with pytest.raises(ValueError, match="'transform' must be"):
        RewardModelConfig(transform="tanh")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'label' must be"):
        RewardModelConfig(label=-1)
