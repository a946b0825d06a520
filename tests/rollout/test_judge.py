"""The LLM judge's reward (nodes/rollout/judge.py) against a scripted judge: its parsers, the
template, batching, the cache, the timeout, and what a failure or an unparseable answer scores
(``default``) or does (``drop``: the episode fails, so its group is dropped)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nodes.rollout import judge as judge_module
from nodes.rollout.judge import (
    Judge,
    JudgeConfig,
    JudgeDropError,
    JudgeParseError,
    fill_template,
    parse_answer,
)
from nodes.rollout.models import ModelCallError
from nodes.rollout.reward import RewardRunner


class ScriptedJudge:
    """A model client whose ``/generate`` answers each prompt with ``answer(prompt)``; records the
    batches it was sent. ``hang``: never answers; ``fail``: every call raises."""

    def __init__(self, answer: Any = None, hang: bool = False, fail: bool = False) -> None:
        self.answer = answer or (lambda prompt: "yes")
        self.hang, self.fail = hang, fail
        self.batches: list[list[str]] = []

    async def post(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> Any:
        assert path == "/generate"
        self.batches.append(list(body["text"]))
        if self.hang:
            await asyncio.Event().wait()
        if self.fail:
            raise ModelCallError("model 'judge': no server answered /generate within 1 s")
        return [{"text": self.answer(p)} for p in body["text"]]


ITEM = {"question": "What is 2 + 3?", "answer": "5", "rubric": "be kind"}


@pytest.mark.parametrize(
    ("cfg", "text", "want"),
    [
        (JudgeConfig(parser="score", score_min=0, score_max=10), "Reasoning... Score: 7", 0.7),
        (JudgeConfig(parser="score", score_min=1, score_max=5), "I give it 2 then revise to 5", 1.0),
        (JudgeConfig(parser="yes_no"), "Yes, the final answer is right.", 1.0),
        (JudgeConfig(parser="yes_no"), "no.", 0.0),
        (JudgeConfig(parser="choice", choices={"A": 1.0, "B": 0.25}), "The best is B, then A", 0.25),
    ],
)
def test_parsers_read_the_judges_answer(cfg: JudgeConfig, text: str, want: float) -> None:
    assert parse_answer(text, cfg) == pytest.approx(want)


@pytest.mark.parametrize(
    ("cfg", "text", "why"),
    [
        (JudgeConfig(parser="score"), "great answer", "no number"),
        (JudgeConfig(parser="score", score_max=10), "Score: 11", "outside"),
        (JudgeConfig(parser="yes_no"), "perhaps", "neither yes nor no"),
        (JudgeConfig(parser="choice", choices={"A": 1.0}), "C", "none of"),
    ],
)
def test_unparseable_answers_are_refused(cfg: JudgeConfig, text: str, why: str) -> None:
    with pytest.raises(JudgeParseError, match=why):
        parse_answer(text, cfg)


def test_template_fills_prompt_completion_answer_and_columns() -> None:
    text = fill_template("Q={prompt} A={answer} R={rubric} C={completion}", "it is 5", ITEM)
    assert text == "Q=What is 2 + 3? A=5 R=be kind C=it is 5"
    with pytest.raises(KeyError, match=r"names \{style\}"):
        fill_template("{style}", "x", ITEM)


def test_batches_and_cache() -> None:
    """Completions judged at once go in one call; the same completion of the same item is judged once."""
    judge_module.COUNTERS.update(dict.fromkeys(judge_module.COUNTERS, 0))
    client = ScriptedJudge(lambda p: "yes" if "C=5" in p else "no")
    j = Judge(JudgeConfig(judge="judge", template="C={completion}", batch_size=4, batch_wait_s=0.05), client)

    async def run() -> list[float]:
        first = await asyncio.gather(*(j.score(c, ITEM) for c in ("5", "6", "7")))
        again = await asyncio.gather(j.score("5", ITEM), j.score("6", ITEM))  # cached
        other = await j.score("5", {**ITEM, "question": "other"})  # same text: the template ignores it
        return [*first, *again, other]

    assert asyncio.run(run()) == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert client.batches == [["C=5", "C=6", "C=7"]]  # one call for the three; none after
    assert judge_module.COUNTERS["judge_cache_hits"] == 3 and judge_module.COUNTERS["judge_calls"] == 1


def test_a_full_batch_goes_at_once_and_the_rest_after() -> None:
    client = ScriptedJudge()
    j = Judge(JudgeConfig(judge="judge", template="{completion}", batch_size=2, batch_wait_s=0.01), client)

    async def run() -> list[float]:
        return await asyncio.gather(*(j.score(str(i), ITEM) for i in range(5)))

    assert asyncio.run(run()) == [1.0] * 5
    assert sorted(len(b) for b in client.batches) == [1, 2, 2]


@pytest.mark.parametrize("failure", ["timeout", "error", "unparseable"])
def test_failures_score_the_default_and_are_counted(failure: str) -> None:
    judge_module.COUNTERS.update(dict.fromkeys(judge_module.COUNTERS, 0))
    client = {
        "timeout": ScriptedJudge(hang=True),
        "error": ScriptedJudge(fail=True),
        "unparseable": ScriptedJudge(lambda p: "maybe"),
    }[failure]
    cfg = JudgeConfig(judge="judge", timeout_s=0.2, default=0.5, batch_wait_s=0.0)
    j = Judge(cfg, client)

    async def run() -> list[float]:
        return [await j.score("x", ITEM), await j.score("y", ITEM)]

    assert asyncio.run(run()) == [0.5, 0.5]
    assert judge_module.COUNTERS["judge_errors"] == 2
    assert len(client.batches) == 2  # a failure is not cached: the next sample asks again


def test_drop_fails_the_episode_through_the_reward_runner() -> None:
    """``on_error = "drop"``: the reward runner lets the judge's error through (it scores 0 for
    any other), so the workflow's episode fails and the rollout actor drops the group."""
    cfg = JudgeConfig(judge="judge", on_error="drop", timeout_s=0.2, batch_wait_s=0.0)
    j = Judge(cfg, ScriptedJudge(lambda p: "perhaps"))
    runner = RewardRunner(j.score, timeout_s=5)

    async def run() -> None:
        with pytest.raises(JudgeDropError, match="judge 'judge': JudgeParseError"):
            await runner("x", ITEM)

    asyncio.run(run())
    assert runner.counters["errors"] == 0  # not scored at all


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="score_max"):
        JudgeConfig(score_min=5, score_max=5)
    with pytest.raises(ValueError, match="choices"):
        JudgeConfig(parser="choice")
