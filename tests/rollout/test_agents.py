"""AgentWorkflow: an OpenAI-SDK agent's runs become one group of token-exact trajectories; a
failing or hanging agent drops its group and is counted; the sandboxed Python tool's limits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nodes.rollout.agents import AgentConfig, AgentError, AgentWorkflow
from nodes.rollout.reward import RewardRunner
from nodes.rollout.sandbox import run_python
from tests.rollout.test_openai_endpoint import Scripted, tokenizer  # noqa: F401 - the fixture

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(347 * 82)"}}\n</tool_call>'


def workflow(tok: Any, agent: str, **kw: Any) -> AgentWorkflow:
    return AgentWorkflow(tok, RewardRunner(lambda c, i: 0.0), AgentConfig(agent=agent, **kw))


async def test_the_python_tool_agent_is_one_trajectory_per_run(tokenizer: Any) -> None:  # noqa: F811
    wf = workflow(tokenizer, "recipes.sdk_agents.python_tool:run", n_samples=2)
    gen = Scripted(tokenizer, [CALL, CALL, "It is \\boxed{28454}.", "It is \\boxed{28000}."])
    try:
        group = await wf.arun_episode(gen, {"question": "What is 347 * 82?", "answer": "28454"}, "g/e0/1")
    finally:
        await wf.endpoint.aclose()
    assert group.group_id == "g/e0/1" and len(group.trajectories) == 2
    assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]  # each run's own final answer
    for t in group.trajectories:
        t.validate()
        assert t.meta["tool_calls"] == 1 and t.meta["turns"] == 2 and t.meta["info"]["tool_calls"] == 1
        # the tool's answer is context (mask 0) between the model's two turns, never trained on
        text = tokenizer.decode([i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if not m])
        assert "<tool_response>\n28454\n</tool_response>" in text
        assert "print(347 * 82)" in tokenizer.decode(
            [i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if m]
        )
    # the second turn extended the first turn's ids: two requests per run, the second a continuation
    firsts, seconds = gen.requests[:2], gen.requests[2:]
    assert all(any(s.input_ids[: len(f.input_ids)] == f.input_ids for f in firsts) for s in seconds)
    assert wf.counters == {"agent_runs": 2, "agent_errors": 0, "agent_timeouts": 0, "history_edits": 0}


async def test_the_guided_agent_shows_its_example_and_makes_the_first_completion_call(
    tokenizer: Any,  # noqa: F811
) -> None:
    wf = workflow(tokenizer, "recipes.sdk_agents.python_tool:run_guided", n_samples=1)
    rest = CALL.removeprefix("<tool_call>\n")  # the endpoint writes the opening (tool_choice required)
    gen = Scripted(tokenizer, [rest, "347 * 82 = \\boxed{28454}"])
    try:
        group = await wf.arun_episode(gen, {"question": "What is 347 * 82?", "answer": "28454"}, "g/e0/2")
    finally:
        await wf.endpoint.aclose()
    (t,) = group.trajectories
    assert t.reward == 1.0 and t.meta["info"]["tool_calls"] == 1 and t.meta["info"]["turns"] == 2
    first = tokenizer.decode(gen.requests[0].input_ids)
    assert "What is 123 * 45?" in first and "print(123 * 45)" in first  # the worked example
    assert first.endswith("<tool_call>\n")  # the forced opening: context, never trained on
    trained = tokenizer.decode([i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if m])
    assert "<tool_call>" not in trained and "print(347 * 82)" in trained


async def failing(client: Any, item: Any) -> float:
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    raise KeyError("the agent's own bug")


async def hanging(client: Any, item: Any) -> float:
    await asyncio.Event().wait()
    return 1.0


async def bad_reward(client: Any, item: Any) -> Any:
    return {"score": 1.0}


@pytest.mark.parametrize(
    ("agent", "kw", "counter", "message"),
    [
        ("tests.rollout.test_agents:failing", {}, "agent_errors", "raised KeyError"),
        (
            "tests.rollout.test_agents:hanging",
            {"episode_timeout_s": 0.2},
            "agent_timeouts",
            r"ran past 0\.2s",
        ),
        ("tests.rollout.test_agents:bad_reward", {}, None, "without 'reward'"),
    ],
)
async def test_a_failed_agent_drops_its_group_and_is_counted(
    tokenizer: Any,  # noqa: F811
    agent: str,
    kw: dict[str, Any],
    counter: str | None,
    message: str,
) -> None:
    wf = workflow(tokenizer, agent, n_samples=2, **kw)
    try:
        with pytest.raises(AgentError, match=message):
            await wf.arun_episode(Scripted(tokenizer, []), {"question": "q"}, "g")
        assert not wf.endpoint.episodes  # every run's episode closed
    finally:
        await wf.endpoint.aclose()
    if counter:
        assert wf.counters[counter] >= 1


def test_an_agent_workflow_needs_an_agent() -> None:
    from recipes.gsm8k_config import ConfigError, load_config

    with pytest.raises(ValueError, match="'agent' must be an import path"):
        AgentConfig()
    with pytest.raises(ConfigError, match=r"'rollout\.workflow_args\.agent' must be an import path"):
        load_config(None, ["rollout.workflow=nodes.rollout.agents:AgentWorkflow"])
    cfg = load_config(
        None,
        [
            "rollout.workflow=nodes.rollout.agents:AgentWorkflow",
            "rollout.workflow_args.agent=recipes.sdk_agents.python_tool:run",
        ],
    )
    assert cfg.rollout.workflow_args == AgentConfig(agent="recipes.sdk_agents.python_tool:run")


async def test_sandbox_runs_code_and_enforces_its_limits() -> None:
    ok = await run_python("print(sum(range(10)))")
    assert ok.stdout == "45\n" and ok.returncode == 0 and ok.as_text() == "45"
    slow = await run_python("while True: pass", timeout_s=1.0)
    assert slow.timed_out and "time limit" in slow.as_text()
    big = await run_python("x = bytearray(1 << 31)", memory_mb=256)
    assert big.returncode != 0 and "MemoryError" in big.stderr
    net = await run_python(
        "import socket\ns = socket.create_connection(('127.0.0.1', 9), timeout=2)", timeout_s=5.0
    )
    assert net.returncode != 0  # no route (own namespace) or sockets refused: never a connection
    assert ("unreachable" in net.stderr) if net.network_isolated else ("disabled" in net.stderr)
    bad = await run_python("1 / 0")
    assert bad.as_text().endswith("ZeroDivisionError: division by zero")
