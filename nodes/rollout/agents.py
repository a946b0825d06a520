"""Training agents written against the OpenAI SDK or the Anthropic SDK, unchanged.

``[rollout] workflow = "nodes.rollout.agents:AgentWorkflow"`` with
``[rollout.workflow_args] agent = "my_pkg.my_agent:run"``, where::

    async def run(client: openai.AsyncOpenAI, item: dict) -> float | dict:
        ...  # chat.completions.create(...) with tools, running the tools itself, as any agent does
        return reward  # or {"reward": r, "turns": 3, ...}: the other numbers reach the metrics

With ``sdk = "anthropic"`` the agent is given an ``anthropic.AsyncAnthropic`` on the same episode
instead, and calls ``client.messages.create(...)`` (the endpoint's Messages API).

Each of an item's ``n_samples`` runs of the agent is an episode with its own base_url on the rollout
actor's OpenAI-compatible endpoint (nodes/rollout/openai_endpoint.py), so its completions are its
own: the endpoint keeps them as token sequences, continuation by continuation, with the model's
tokens under the loss mask. The runs of one item form a GRPO group (a run whose agent edited its
history contributes one trajectory per sample, each with the run's reward). An agent that raises or
runs past ``episode_timeout_s`` drops the item's group: counted (``rollout/agent_errors``,
``rollout/agent_timeouts``), logged with its traceback, and the run goes on.

Where the agent's code runs is ``agent_runner`` (nodes/rollout/agent_runner.py): ``"thread"``, the
default, gives each run a thread and event loop of its own, so a tool that blocks (``time.sleep``, a
sync HTTP call) holds up only its own episode; ``"loop"`` runs it on the actor's event loop;
``"process"`` in ``agent_processes`` worker processes. bench/agent_endpoint.py ``--runners``
measures them (bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import structlog

from nodes.common.plugins import resolve
from nodes.rollout.agent_runner import ProcessRunner, in_thread, run_agent
from nodes.rollout.openai_endpoint import ChatEndpoint
from nodes.rollout.reward import RewardRunner
from nodes.rollout.workflows import all_or_none
from protocols.rl import TrajectoryGroup
from protocols.runtime.codec import register
from rlactors.base.tomlconf import above, at_least, check_ranges, import_path

__all__ = ["AgentConfig", "AgentError", "AgentWorkflow"]

log = structlog.get_logger(__name__)


class AgentError(RuntimeError):
    """An agent run failed (its exception, or its time ran out): the item's group is dropped."""


@register
@dataclass
class AgentConfig:
    """An agent function by import path and how its episodes run."""

    # the agent: async def run(client, item) -> float | dict, its reward (and metrics)
    agent: str = field(default="", metadata=import_path())
    n_samples: int = field(default=4, metadata=at_least(1))  # runs of the agent per item: one group
    episode_timeout_s: float = field(default=300.0, metadata=above(0))  # one run of the agent
    # a completion's token limit when the agent's request does not say (OpenAI's defaults otherwise)
    max_new_tokens: int = field(default=256, metadata=at_least(1))
    # a completion's temperature when the agent's request does not say; 0 = greedy
    temperature: float = field(default=1.0, metadata=at_least(0))
    model_name: str = "policy"  # what /v1/models lists; any name is accepted in requests
    tool_parser: str = "hermes"  # how tool calls are read: hermes (= qwen25), or module:fn
    # where the agent's code runs: "thread" (a thread and event loop per run: a blocking tool holds up
    # only its run), "loop" (the actor's event loop), "process" (agent_processes worker processes)
    agent_runner: Literal["loop", "thread", "process"] = "thread"
    # "process": worker processes, one run each at a time (runs beyond wait, their time counting)
    agent_processes: int = field(default=4, metadata=at_least(1))
    # the client the agent is given: "openai" (openai.AsyncOpenAI on its episode's base_url) or
    # "anthropic" (anthropic.AsyncAnthropic on the same episode: its Messages API)
    sdk: Literal["openai", "anthropic"] = "openai"

    def __post_init__(self) -> None:
        check_ranges(self)


class AgentWorkflow:
    """Runs an agent (on the OpenAI or the Anthropic SDK) ``n_samples`` times per item through the
    rollout actor's endpoint."""

    config_class: ClassVar[type] = AgentConfig

    def __init__(self, tokenizer: Any, reward: RewardRunner, config: AgentConfig | None = None) -> None:
        self.tokenizer, self.config = tokenizer, config or AgentConfig()
        self.agent = resolve(self.config.agent, "rollout.workflow_args.agent")
        c = self.config
        # one endpoint for the workflow's episodes, whichever client each generates with (the
        # rollout actor's, an evaluation's); started with the first episode, on its loop
        self.endpoint = ChatEndpoint(
            None,
            tokenizer,
            c.model_name,
            default_max_tokens=c.max_new_tokens,
            default_temperature=c.temperature,
            tool_parser=c.tool_parser,
        )
        self._started: asyncio.Future[str] | None = None
        self.counters = dict.fromkeys(("agent_runs", "agent_errors", "agent_timeouts", "history_edits"), 0)
        self.processes = ProcessRunner(c.agent_processes)  # "process": its workers start with the first run

    async def _endpoint(self) -> ChatEndpoint:
        if self._started is None:  # the first episode starts it; the others wait for the same start
            self._started = asyncio.ensure_future(self.endpoint.start())
        await asyncio.shield(self._started)
        return self.endpoint

    async def arun_episode(self, client: Any, item: Any, group_id: str | None = None) -> TrajectoryGroup:
        """Run the agent ``n_samples`` times on ``item``; one group of their trajectories."""
        import uuid

        gid = group_id or uuid.uuid4().hex
        endpoint = await self._endpoint()
        # one failed run drops the group: the others are cancelled rather than left to use the servers
        runs = await all_or_none(
            self._run(endpoint, client, item, f"{gid}/a{i}") for i in range(self.config.n_samples)
        )
        trajs = []
        for reward, info, episode in runs:
            self.counters["history_edits"] += max(0, episode.counters["new_samples"] - 1)
            c = episode.counters
            trajs += episode.trajectories(
                reward, gid, turns=c["calls"], tool_calls=c["tool_calls"], info=info
            )
        if not trajs:
            raise AgentError(f"group {gid}: the agent made no completion in any of its runs")
        return TrajectoryGroup(gid, trajs)

    async def _run(
        self, endpoint: ChatEndpoint, client: Any, item: Any, name: str
    ) -> tuple[float, dict[str, float], Any]:
        episode, url = endpoint.open_episode(client=client)  # a fresh id: a group id has slashes
        self.counters["agent_runs"] += 1
        c = self.config
        try:
            if c.agent_runner == "thread":
                out = await in_thread(self.agent, url, item, c.episode_timeout_s, c.sdk)
            elif c.agent_runner == "process":
                out = await self.processes.run(c.agent, url, item, c.episode_timeout_s, c.sdk)
            else:
                out = await run_agent(self.agent, url, item, c.episode_timeout_s, c.sdk)
        except TimeoutError:
            self.counters["agent_timeouts"] += 1
            raise AgentError(f"agent {self.config.agent} ran past {self.config.episode_timeout_s}s") from None
        except Exception as e:  # a user's agent: whatever it raises fails its episode
            self.counters["agent_errors"] += 1
            log.warning("agent.failed", agent=self.config.agent, episode=name, exc_info=True)
            raise AgentError(f"agent {self.config.agent} raised {type(e).__name__}: {e}") from e
        finally:
            endpoint.close_episode(episode.id)
        reward, info = _reward(out, self.config.agent)
        return reward, info, episode


def _reward(out: Any, agent: str) -> tuple[float, dict[str, float]]:
    """The reward and the numeric info of what an agent returned."""
    if isinstance(out, dict):
        if "reward" not in out:
            raise AgentError(f"agent {agent} returned a dict without 'reward': {sorted(out)}")
        info = {k: float(v) for k, v in out.items() if k != "reward" and isinstance(v, (int, float))}
        out = out["reward"]
    else:
        info = {}
    if isinstance(out, bool) or not isinstance(out, (int, float)) or not math.isfinite(out):
        raise AgentError(
            f"agent {agent} returned {out!r}: a finite number (or a dict with 'reward') is needed"
        )
    return float(out), info
