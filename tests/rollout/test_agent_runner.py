"""``agent_runner``: where an agent's code runs. A tool that blocks in ``time.sleep`` holds up only
its own episode when runs are in threads (16 episodes block at once: their blocking intervals
overlap, the 2 s of each spent together rather than 32 s one after another) or worker processes;
on the actor's loop it stalls the others (the intervals follow one another: the test tells the
runners apart). A run out of time is counted in every runner."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from nodes.rollout.agents import AgentConfig, AgentError, AgentWorkflow
from nodes.rollout.reward import RewardRunner
from tests.rollout import blocking_agents
from tests.rollout.test_openai_endpoint import Scripted
from tests.rollout.test_responses import tokenizer  # noqa: F401 - the fixture


def workflow(tok: Any, agent: str, runner: str, n: int, **kw: Any) -> AgentWorkflow:
    config = AgentConfig(
        agent=f"tests.rollout.blocking_agents:{agent}", n_samples=n, agent_runner=runner, **kw
    )
    return AgentWorkflow(tok, RewardRunner(lambda c, i: 0.0), config)


@pytest.mark.parametrize(("runner", "n", "block_s"), [("thread", 16, 2.0), ("loop", 2, 0.5)])
async def test_a_blocking_tool_holds_up_only_its_own_episode_in_threads(
    tokenizer: Any,  # noqa: F811
    runner: str,
    n: int,
    block_s: float,
) -> None:
    intervals = blocking_agents.INTERVALS
    intervals.clear()
    wf = workflow(tokenizer, "blocking", runner, n)
    try:
        group = await wf.arun_episode(Scripted(tokenizer, []), {"block_s": block_s}, "g")
    finally:
        await wf.endpoint.aclose()
    assert [t.reward for t in group.trajectories] == [1.0] * n and len(intervals) == n
    starts, ends = [s for s, _ in intervals], [e for _, e in intervals]
    if runner == "thread":  # all blocked at once: one instant inside every interval
        assert max(starts) < min(ends)
    else:  # on the actor's loop each block stalls the others: the intervals follow one another
        first, second = sorted(intervals)
        assert second[0] >= first[1]


def files(folder: Path) -> set[str]:
    return {p.read_text() for p in folder.iterdir()}


async def test_worker_processes_block_at_once(tokenizer: Any, tmp_path: Path) -> None:  # noqa: F811
    wf = workflow(tokenizer, "waiting", "process", 2, agent_processes=2)
    try:
        group = await wf.arun_episode(Scripted(tokenizer, []), {"dir": str(tmp_path), "runs": 2}, "g")
    finally:
        await wf.endpoint.aclose()
        wf.processes.close()
    assert [t.reward for t in group.trajectories] == [1.0] * 2  # both blocked at once
    pids = files(tmp_path)
    assert len(pids) == 2 and str(os.getpid()) not in pids  # two processes, neither this one


@pytest.mark.parametrize(("runner", "agent"), [("thread", "sleeping"), ("loop", "hanging")])
async def test_a_run_past_its_timeout_is_counted(tokenizer: Any, runner: str, agent: str) -> None:  # noqa: F811
    wf = workflow(tokenizer, agent, runner, 1, episode_timeout_s=0.5)
    try:
        with pytest.raises(AgentError, match=r"ran past 0\.5s"):
            await wf.arun_episode(Scripted(tokenizer, []), {}, "g")
        assert not wf.endpoint.episodes and wf.counters["agent_timeouts"] == 1
    finally:
        await wf.endpoint.aclose()


def test_the_runner_is_a_setting() -> None:
    from recipes.gsm8k_config import ConfigError, load_config

    assert AgentConfig(agent="a.b:run").agent_runner == "thread"  # the measured default (bench/RESULTS.md)
    base = [
        "rollout.workflow=nodes.rollout.agents:AgentWorkflow",
        "rollout.workflow_args.agent=recipes.sdk_agents.python_tool:run",
    ]
    cfg = load_config(None, [*base, "rollout.workflow_args.agent_runner=process"])
    assert cfg.rollout.workflow_args.agent_runner == "process"
    with pytest.raises(ConfigError, match="agent_runner"):
        load_config(None, [*base, "rollout.workflow_args.agent_runner=fork"])
