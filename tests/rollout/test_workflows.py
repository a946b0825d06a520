"""Workflows (single-turn RLVR, multi-turn retry) with a scripted client, and the GSM8K reward."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from nodes.rollout.client import GenRequest, GenResult
from nodes.rollout.reward import RewardRunner, extract_answer, gsm8k_reward
from nodes.rollout.workflows import MultiTurnConfig, MultiTurnWorkflow, RLVRConfig, RLVRWorkflow, chat_ids

ITEM = {
    "question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
    "answer": "#### 72",
}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from nodes.inference.models import ensure_smollm2_tokenizer

    return AutoTokenizer.from_pretrained(ensure_smollm2_tokenizer())


class ScriptedClient:
    """Answers each request with the next scripted text (as ids + EOS), stamping version 3."""

    def __init__(self, tok, answers: list[str]) -> None:
        self.tok, self.answers, self.requests = tok, list(answers), []

    async def agenerate(self, request: GenRequest) -> GenResult:
        self.requests.append(request)
        ids = [*self.tok.encode(self.answers.pop(0), add_special_tokens=False), self.tok.eos_token_id]
        return GenResult(
            request.rid or "",
            ids,
            [-0.5] * len(ids),
            [3] * len(ids),
            "stop",
            "",
            len(request.input_ids),
            [7],
            "http://x",
            aborts=1,
        )


async def test_rlvr_group_of_n_samples(tok) -> None:
    client = ScriptedClient(tok, ["So \\boxed{72}.", "It is \\boxed{70}", "no idea"])
    wf = RLVRWorkflow(tok, gsm8k_reward, RLVRConfig(n_samples=3, prompt_suffix=" Box it."))
    group = await wf.arun_episode(client, ITEM, group_id="g1")
    group.validate()
    assert group.group_id == "g1" and sorted(group.rewards) == [0.0, 0.0, 1.0]
    prompt = chat_ids(tok, [{"role": "user", "content": ITEM["question"] + " Box it."}])
    assert [list(r.input_ids) for r in client.requests] == [prompt] * 3
    assert len({r.rid for r in client.requests}) == 3
    for t in group.trajectories:
        # the workflow's own trajectories hold arrays of the wire dtypes: the codec sends them as they are
        assert [(type(a), a.dtype) for a in (t.input_ids, t.loss_mask, t.logprobs, t.versions)] == [
            (np.ndarray, np.int32),
            (np.ndarray, np.int8),
            (np.ndarray, np.float32),
            (np.ndarray, np.int32),
        ]
        assert t.input_ids[: len(prompt)].tolist() == prompt and t.prompt_len == len(prompt)
        assert t.loss_mask.tolist() == [0] * len(prompt) + [1] * (t.num_tokens - len(prompt))
        assert t.logprobs.tolist() == [0.0] * len(prompt) + [-0.5] * (t.num_tokens - len(prompt))
        assert (
            set(t.versions[len(prompt) :].tolist()) == {3}
            and t.meta["cached_tokens"] == 7
            and t.meta["aborts"] == 1
        )


async def test_multi_turn_retry_until_correct(tok) -> None:
    client = ScriptedClient(tok, ["\\boxed{70}", "\\boxed{72}"])
    cfg = MultiTurnConfig(n_samples=1, max_turns=3, turn_discount=0.5)
    group = await MultiTurnWorkflow(tok, gsm8k_reward, cfg).arun_episode(client, ITEM, "g2")
    group.validate()
    [t] = group.trajectories
    assert t.reward == 0.5 and t.meta["turns"] == 2
    first, second = client.requests
    assert first.rid == second.rid  # sticky: the second turn returns to the server holding the prefix
    assert list(second.input_ids[: len(first.input_ids)]) == list(first.input_ids)
    # the sequence decodes to exactly what the chat template renders for the whole conversation
    convo = [
        {"role": "user", "content": ITEM["question"]},
        {"role": "assistant", "content": "\\boxed{70}"},
        {"role": "user", "content": cfg.feedback},
        {"role": "assistant", "content": "\\boxed{72}"},
    ]
    rendered = tok.apply_chat_template(convo, tokenize=False)
    assert tok.decode(t.input_ids.tolist(), skip_special_tokens=False) == rendered.rstrip("\n")
    # loss only on the two answers; the feedback turn is context
    answer_ids = [
        [*tok.encode(a, add_special_tokens=False), tok.eos_token_id] for a in ("\\boxed{70}", "\\boxed{72}")
    ]
    assert sum(t.loss_mask) == sum(map(len, answer_ids))
    assert [tid for tid, m in zip(t.input_ids, t.loss_mask, strict=True) if m] == answer_ids[0] + answer_ids[
        1
    ]


async def test_multi_turn_gives_up_after_max_turns(tok) -> None:
    client = ScriptedClient(tok, ["1", "2", "3"])
    group = await MultiTurnWorkflow(
        tok, gsm8k_reward, MultiTurnConfig(n_samples=1, max_turns=3)
    ).arun_episode(client, ITEM)
    assert (
        group.trajectories[0].reward == 0.0
        and group.trajectories[0].meta["turns"] == 3
        and not client.answers
    )


@pytest.mark.parametrize(
    ("completion", "reward"),
    [("so \\boxed{72}", 1.0), ("\\boxed{72.0}", 1.0), ("\\boxed{\\$72}", 1.0), ("#### 72", 1.0),
     ("\\boxed{1,072} no wait \\boxed{72}", 1.0), ("\\boxed{71}", 0.0), ("72", 0.0), ("\\boxed{}", 0.0)],
)  # fmt: skip
def test_gsm8k_reward(completion: str, reward: float) -> None:
    assert gsm8k_reward(completion, ITEM) == reward


def test_gsm8k_reward_falls_back_to_math_verify_and_extracts_nested_braces() -> None:
    assert extract_answer("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert gsm8k_reward("\\boxed{\\frac{1}{2}}", {"answer": "0.5"}) == 1.0
    assert gsm8k_reward("\\boxed{\\frac{1}{3}}", {"answer": "\\frac{2}{6}"}) == 1.0
    assert gsm8k_reward("\\boxed{x+1}", {"answer": "\\frac{1}{3}"}) == 0.0


async def test_reward_runner_sync_off_loop_async_timeout_and_errors() -> None:
    loop_thread = threading.get_ident()
    seen = []

    def sync_reward(text: str, item: dict) -> float:
        seen.append(threading.get_ident())
        return 1.0

    runner = RewardRunner(sync_reward, timeout_s=5)
    assert await runner("x", {}) == 1.0 and seen[0] != loop_thread
    runner.close()

    release = threading.Event()
    slow = RewardRunner(lambda t, i: release.wait(30) and 1.0, timeout_s=0.05)
    assert await slow("x", {}) == 0.0 and slow.counters["timeouts"] == 1
    release.set()
    slow.close()

    async def async_reward(text: str, item: dict) -> float:
        await asyncio.sleep(30)
        return 1.0

    ar = RewardRunner(async_reward, timeout_s=0.05)
    assert await ar("x", {}) == 0.0 and ar.counters["timeouts"] == 1

    def broken(text: str, item: dict) -> float:
        raise KeyError("answer")

    br = RewardRunner(broken)
    assert await br("x", {}) == 0.0 and br.counters["errors"] == 1
    br.close()


def test_a_runaway_symbolic_check_is_killed_and_the_next_one_works(monkeypatch) -> None:
    import time

    from nodes.rollout import reward

    monkeypatch.setattr(reward, "SYMBOLIC_TIMEOUT_S", 3.0)
    assert gsm8k_reward("\\boxed{\\frac{1}{2}}", {"answer": "0.5"}) == 1.0  # the worker is up
    worker = reward._SYMBOLIC._proc
    t0 = time.monotonic()
    assert gsm8k_reward("\\boxed{9^{9^{9^{9}}}}", {"answer": "5"}) == 0.0  # sympy would never return
    assert time.monotonic() - t0 < 20 and not worker.is_alive()  # killed, not left spinning
    assert gsm8k_reward("\\boxed{\\frac{1}{3}}", {"answer": "\\frac{2}{6}"}) == 1.0  # a fresh worker
    assert gsm8k_reward("\\boxed{" + "1+" * 200 + "1}", {"answer": "x"}) == 0.0  # too long to try


def test_final_number_reward_reads_boxed_else_the_last_number() -> None:
    from nodes.rollout.reward import final_number_reward as reward

    item = {"answer": "38"}
    assert reward("19 + 19 = 38.", item) == 1.0
    assert reward("He has 38 apples now", item) == 1.0  # the last number is what counts ...
    assert reward("38 apples, then 1 more is 39", item) == 0.0
    assert reward("so 19 + 19 = 38", item) == 1.0
    assert reward("\\boxed{38} not 40", item) == 1.0  # ... unless the answer is boxed
    assert reward("\\boxed{37}, surely 38", item) == 0.0
    assert reward("1,038", {"answer": "1038"}) == 1.0 and reward("no number at all", item) == 0.0


@dataclasses.dataclass
class BonusSettings:
    bonus: float = 0.0


def bonus_reward(completion: str, item: dict, settings: BonusSettings) -> float:
    """A reward with settings of its own ([reward.fn_args])."""
    return settings.bonus


bonus_reward.config_class = BonusSettings  # type: ignore[attr-defined]


async def test_a_reward_functions_settings_reach_it_in_the_workflow() -> None:
    from nodes.rollout.reward import RewardConfig
    from nodes.rollout.workflows import WorkflowSpec, build_workflow

    fn = "tests.rollout.test_workflows:bonus_reward"
    wf = build_workflow(WorkflowSpec(reward=RewardConfig(fn=fn, fn_args=BonusSettings(bonus=0.75))))
    assert await wf.reward("anything", {}) == 0.75 and wf.reward.counters["errors"] == 0
