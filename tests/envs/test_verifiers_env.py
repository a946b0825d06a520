"""VerifiersWorkflow with the real verifiers package: a SingleTurnEnv and a ToolEnv (its tool really
runs) become one group of token-exact trajectories with the rubric's rewards and metrics; a bad
environment drops its group and is counted; one that cannot load is a one-line config error."""

from __future__ import annotations

from typing import Any

import pytest

from nodes.rollout.environments import EnvError, VerifiersConfig, VerifiersWorkflow
from nodes.rollout.reward import RewardRunner
from tests.rollout.test_openai_endpoint import Scripted, tokenizer  # noqa: F401 - the fixture

pytest.importorskip("verifiers")

CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 656, "b": 31}}\n</tool_call>'


class ByTurn(Scripted):
    """Answers a request without a tool result with the tool call, one with a tool result with the
    next final answer: each episode calls the tool once, whatever order the episodes run in."""

    def __init__(self, tok: Any, call: str, finals: list[str]) -> None:
        super().__init__(tok, [])
        self.call, self.finals = call, list(finals)

    async def agenerate(self, request: Any) -> Any:
        seen = self.tok.decode(request.input_ids)
        self.script = [self.finals.pop(0) if "<tool_response>" in seen else self.call]
        return await super().agenerate(request)


def workflow(tok: Any, env: str, **kw: Any) -> VerifiersWorkflow:
    return VerifiersWorkflow(tok, RewardRunner(lambda c, i: 0.0), VerifiersConfig(env=env, **kw))


def first_item(wf: VerifiersWorkflow) -> dict[str, Any]:
    row = dict(wf.env.get_dataset()[0])
    return {**row, "id": "t-0"}


async def test_a_single_turn_env_is_scored_by_its_rubric(tokenizer: Any) -> None:  # noqa: F811
    wf = workflow(tokenizer, "recipes.toy_envs.easy_sums", n_samples=2)
    item = first_item(wf)
    gen = Scripted(tokenizer, [f"It is \\boxed{{{item['answer']}}}.", "It is 99."])
    try:
        group = await wf.arun_episode(gen, item, "g/0")
    finally:
        await wf.episodes.endpoint.aclose()
    assert group.group_id == "g/0" and len(group.trajectories) == 2
    assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]  # the rubric's correct_answer
    infos = sorted((t.meta["info"] for t in group.trajectories), key=lambda i: i["correct_answer"])
    assert [i["correct_answer"] for i in infos] == [0.0, 1.0] and infos[1]["boxed"] == 1.0
    assert infos[1]["correct_answer/weight"] == 1.0 and infos[1]["boxed/weight"] == 0.0
    # the environment's own prompt reached the model: its system prompt, its question
    text = tokenizer.decode(gen.requests[0].input_ids)
    assert "careful math tutor" in text and item["question"] in text
    assert wf.counters["env_errors"] == wf.counters["env_timeouts"] == 0


async def test_a_tool_env_runs_its_tool_and_each_episode_is_one_token_sequence(tokenizer: Any) -> None:  # noqa: F811
    wf = workflow(tokenizer, "recipes.toy_envs.calculator", n_samples=2, env_args={"limit": 4})
    item = first_item(wf)
    assert item["question"] == "What is 656 * 31?"
    gen = ByTurn(tokenizer, CALL, ["\\boxed{20336}", "\\boxed{20000}"])
    try:
        group = await wf.arun_episode(gen, item, "g/1")
    finally:
        await wf.episodes.endpoint.aclose()
    assert len(group.trajectories) == 2  # one trajectory per episode: no history edits
    assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]
    for t in group.trajectories:
        t.validate()
        assert t.meta["info"]["total_tool_calls"] == 1.0 and t.meta["info"]["multiply_calls"] == 1.0
        assert t.meta["turns"] == 2 and t.meta["tool_calls"] == 1
        # the tool's answer, computed by the tool here, is context between the model's two turns
        context = tokenizer.decode([i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if not m])
        assert "20336" in context
    # each episode's second request extends its first request's ids (token-exact continuation)
    firsts = [r for r in gen.requests if "<tool_response>" not in tokenizer.decode(r.input_ids)]
    seconds = [r for r in gen.requests if r not in firsts]
    assert len(firsts) == len(seconds) == 2
    assert all(any(s.input_ids[: len(f.input_ids)] == f.input_ids for f in firsts) for s in seconds)
    assert all(len(s.input_ids) > max(len(f.input_ids) for f in firsts) for s in seconds)
    assert wf.counters["history_edits"] == 0 and wf.counters["env_episodes"] == 2


@pytest.mark.parametrize(
    ("kind", "counter", "message"),
    [
        ("raises", "env_errors", "raised KeyError"),
        ("nan", "env_errors", "returned nan, not a finite number"),
        ("text", "env_errors", "returned 'yes', not a finite number"),
        ("raises_in_rubric", "env_errors", "raised ZeroDivisionError"),
        ("hangs", "env_timeouts", r"ran past 0\.5s"),
    ],
)
async def test_a_bad_environment_drops_its_group_and_is_counted(
    tokenizer: Any,  # noqa: F811
    kind: str,
    counter: str,
    message: str,
) -> None:
    wf = workflow(
        tokenizer, "tests.envs.sample_env", n_samples=2, env_args={"kind": kind}, episode_timeout_s=0.5
    )
    try:
        with pytest.raises(EnvError, match=message):
            await wf.arun_episode(Scripted(tokenizer, []), first_item(wf), "g")
        assert not wf.episodes.endpoint.episodes  # every episode closed
        # the next group of the same workflow is tried (and fails the same way): the run goes on
        with pytest.raises(EnvError):
            await wf.arun_episode(Scripted(tokenizer, []), first_item(wf), "g2")
    finally:
        await wf.episodes.endpoint.aclose()
    assert wf.counters[counter] == 2


def test_an_environment_that_cannot_load_is_a_config_error() -> None:
    from recipes.gsm8k_config import ConfigError, load_config

    base = ["rollout.workflow=nodes.rollout.environments:VerifiersWorkflow"]
    with pytest.raises(ConfigError, match=r"'rollout\.workflow_args\.env' must name a verifiers environment"):
        load_config(None, base)
    with pytest.raises(ConfigError, match=r"'rollout\.workflow_args\.env' = 'no_such_env_module'"):
        load_config(None, [*base, "rollout.workflow_args.env=no_such_env_module"])
    with pytest.raises(ConfigError, match="load_environment failed: RuntimeError: no such dataset here"):
        load_config(
            None,
            [
                *base,
                "rollout.workflow_args.env=tests.envs.sample_env",
                'rollout.workflow_args.env_args={kind = "load_fails"}',
            ],
        )
    cfg = load_config(None, [*base, "rollout.workflow_args.env=recipes.toy_envs.easy_sums"])
    assert isinstance(cfg.rollout.workflow_args, VerifiersConfig)


def test_a_hub_id_loads_the_installed_package_as_a_module_path_does(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``owner/my-env`` is the module ``my_env`` (what ``pip install`` of a Hub environment gives)."""
    (tmp_path / "my_hub_env.py").write_text("from tests.envs.sample_env import load_environment\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    by_id = VerifiersConfig(env="someone/my-hub-env", env_args={"kind": "ok"})
    by_path = VerifiersConfig(env="tests.envs.sample_env", env_args={"kind": "ok"})
    from nodes.driver.data import DataConfig

    cfg = DataConfig(source="env", eval_size=4)
    train, held, about, held_about = by_id.env_data(cfg)
    same = by_path.env_data(cfg)
    assert [t["question"] for t in train] == [t["question"] for t in same[0]]  # same rows, same split
    assert [t["question"] for t in held] == [t["question"] for t in same[1]]
    # no eval dataset: a held-out slice, never trained on, and the line says so
    assert len(held) == 3 and not {t["question"] for t in held} & {t["question"] for t in train}
    assert "someone/my-hub-env" in about and "held out, never trained on" in held_about
