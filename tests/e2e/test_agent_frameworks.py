"""The agent framework examples (examples/agents/) trained unchanged: the OpenAI SDK's Responses
API, an OpenAI Agents SDK agent through its Responses model and through
``OpenAIChatCompletionsModel``, a LangGraph agent with ``ChatOpenAI(...).bind_tools(...)``, the
Anthropic SDK's Messages API (``sdk = "anthropic"``), all with the real packages.

First each against scripted model output (fast): the model calls the tool, the framework runs it
and sends the result back, the model answers; the episode is one token sequence (the second request
continued the first, no history edit) and the reward is the answer's. Then one recipe run trains
all of them for 2 steps with the tiny model (tests/e2e/framework_agents.py: every group holds a run
of each), through the rollout actor's endpoint and the default agent runner.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from nodes.rollout.agents import AgentConfig, AgentWorkflow
from nodes.rollout.reward import RewardRunner
from tests.e2e.framework_agents import EXAMPLES
from tests.e2e.test_recipe import recipe, rows
from tests.rollout.test_openai_endpoint import Scripted
from tests.rollout.test_responses import tokenizer  # noqa: F401 - the fixture

CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 347, "b": 82}}\n</tool_call>'
ITEM = {"question": "What is 347 * 82?", "answer": "28454"}
AGENTS = {
    "responses_sdk": "examples.agents.responses_sdk:run",
    "openai_agents_responses": "examples.agents.openai_agents_sdk:run",
    "openai_agents_chat": "examples.agents.openai_agents_sdk:run_chat",
    "langgraph": "examples.agents.langgraph_agent:run",
}
# examples given another SDK's client than OpenAI's (AgentConfig.sdk)
OTHER_SDKS = {"anthropic_sdk": ("examples.agents.anthropic_sdk:run", "anthropic")}


def config(name: str, n_samples: int) -> AgentConfig:
    if name in OTHER_SDKS:
        agent, sdk = OTHER_SDKS[name]
        return AgentConfig(agent=agent, n_samples=n_samples, sdk=sdk)  # type: ignore[arg-type]
    return AgentConfig(agent=AGENTS[name], n_samples=n_samples)


@pytest.mark.parametrize("name", [*AGENTS, *OTHER_SDKS])
async def test_each_example_runs_the_tool_and_is_one_token_exact_episode(tokenizer: Any, name: str) -> None:  # noqa: F811
    wf = AgentWorkflow(tokenizer, RewardRunner(lambda c, i: 0.0), config(name, 1))
    gen = Scripted(tokenizer, [CALL, "347 * 82 = \\boxed{28454}"])
    try:
        group = await wf.arun_episode(gen, ITEM, "g")
    finally:
        await wf.endpoint.aclose()
    (t,) = group.trajectories
    assert t.reward == 1.0 and t.meta["info"]["tool_calls"] == 1 and t.meta["tool_calls"] == 1
    # the tool's result came back as context, and the second request extended the first's ids
    first, second = gen.requests
    out1 = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id]
    assert second.input_ids[: len(first.input_ids) + len(out1)] == first.input_ids + out1
    assert "28454" in tokenizer.decode(second.input_ids[len(first.input_ids) + len(out1) :])
    assert wf.counters["history_edits"] == 0 and t.meta["turns"] == 2
    assert sum(t.loss_mask) == len(out1) + len(tokenizer.encode("347 * 82 = \\boxed{28454}")) + 1


class Cut(Scripted):
    """Every answer cut at the token limit (``finish_reason`` length), as a small model's often are."""

    async def agenerate(self, request: Any) -> Any:
        res = await super().agenerate(request)
        res.finish_reason = "length"
        return res


@pytest.mark.parametrize("name", [*AGENTS, *OTHER_SDKS])
async def test_an_answer_cut_at_the_token_limit_scores_zero_not_an_error(tokenizer: Any, name: str) -> None:  # noqa: F811
    wf = AgentWorkflow(tokenizer, RewardRunner(lambda c, i: 0.0), config(name, 2))
    try:
        group = await wf.arun_episode(Cut(tokenizer, ["The answer is", "The answer is"]), ITEM, "g")
    finally:
        await wf.endpoint.aclose()
    assert [t.reward for t in group.trajectories] == [0.0, 0.0] and wf.counters["agent_errors"] == 0


def test_the_dispatching_agent_is_every_example() -> None:
    assert set(EXAMPLES) == set(AGENTS) | set(OTHER_SDKS)


STEPS, BATCH, SAMPLES = 2, 2, 5


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    """One recipe run of 2 steps training every example (2 groups a step, each holding a run of
    each of the 5 examples); its metrics rows."""
    tmp = tmp_path_factory.mktemp("frameworks")
    data = tmp / "data"
    data.mkdir()
    for split, first, n in (("train", 0, 16), ("test", 50, 4)):
        lines = [
            json.dumps(
                {"question": f"What is {100 + i} * {10 + i}?", "answer": f"#### {(100 + i) * (10 + i)}"}
            )
            for i in range(first, first + n)
        ]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp / "run"
    args = [
        "--config", "recipes/configs/agent_cpu.toml", "model.tiny=true", "data.source=local", f"data.path={data}",
        "data.eval_size=4", "servers.n=1", "trainer.n_ranks=1", f"async.batch_size={BATCH}", "async.max_staleness=1", "async.max_concurrent=4",
        "rollout.workflow_args.agent=tests.e2e.framework_agents:run", f"rollout.workflow_args.n_samples={SAMPLES}",
        "rollout.workflow_args.max_new_tokens=16", "run.eval_every=0", f"run.steps={STEPS}",
        "run.checkpoint_every=0", "metrics.plots=false", "metrics.tensorboard=false", f"run.out_dir={out}",
    ]  # fmt: skip
    done = recipe(args, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    yield rows(out)


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_every_example_trains_two_steps(trained: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    for r in trained:
        assert r["rollout/agent_errors"] == 0 and r["rollout/agent_timeouts"] == 0
        assert r["train/n_seqs"] >= BATCH * SAMPLES and r["train/n_loss_tokens"] > 0
        for name in [*AGENTS, *OTHER_SDKS]:  # every group held a run of every example
            assert r[f"episode/{name}"] == 1.0, name
