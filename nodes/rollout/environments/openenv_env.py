"""Training against OpenEnv environments (``openenv-core``): environment servers with ``reset``/``step``
over a WebSocket session, as TRL and torchforge train them.

``[rollout] workflow = "nodes.rollout.environments:OpenEnvWorkflow"``, and in ``[rollout.workflow_args]``
either ``env_urls = ["http://host:8000", ...]`` (servers already running: a local process, a Docker
container's published port, a Hugging Face Space's URL) or ``env_app = "module:app"`` with ``n_envs``
(the run starts that many servers, each an actor ``env-<i>`` placed like any other that owns one
``uvicorn module:app`` process, health-checks it and is replaced when it dies: env_servers.py). An episode opens its own session on one server, calls ``reset`` (with
``reset_args`` and the item's ``reset`` table, e.g. a seed), then until ``done`` or ``max_turns``: the
observation becomes chat messages (``render``), the model answers through the episode's base_url (a
chat completion on the rollout actor's endpoint: token-exact turns), the answer becomes an action
(``action``), ``step``. The reward is the environment's: the sum of its step rewards or the last
(``reward``). The item's ``n_samples`` episodes form a group. A server that dies or hangs past
``episode_timeout_s`` drops the group (``rollout/env_errors``, ``rollout/env_timeouts``) and the run
goes on; an ``env_urls`` entry that does not answer ``/health`` or an ``env_app`` that does not import
is a config error (exit 2) before any process starts.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import structlog

import rlactors
from nodes.common.plugins import resolve
from nodes.rollout.environments.env_servers import EnvServers, start_env_servers
from nodes.rollout.environments.episodes import (
    EnvEpisodes,
    EnvError,
    EpisodeSettings,
    finite_reward,
    sdk_client,
)
from nodes.rollout.reward import RewardRunner
from nodes.rollout.workflows import all_or_none
from protocols.rl import TrajectoryGroup
from protocols.runtime.codec import register
from rlactors.base.tomlconf import above, at_least

__all__ = ["OpenEnvConfig", "OpenEnvWorkflow", "default_action", "default_messages"]

log = structlog.get_logger(__name__)

HEALTH_TIMEOUT_S = 5.0  # one /health probe


def default_messages(observation: dict[str, Any], turn: int) -> list[dict[str, Any]]:
    """The observation as one user message: its ``prompt``, ``message`` or ``text`` field when it
    has one, else its fields as JSON. ``turn`` counts from 0 (the observation of ``reset``)."""
    for key in ("prompt", "message", "text"):
        if isinstance(observation.get(key), str) and observation[key]:
            return [{"role": "user", "content": observation[key]}]
    return [{"role": "user", "content": json.dumps(observation, sort_keys=True, default=str)}]


def default_action(message: dict[str, Any], observation: dict[str, Any]) -> dict[str, Any]:
    """The model's answer as an action: ``{"message": <its text>}`` (OpenEnv's chat environments'
    action); a tool call's arguments when it made one (``{"tool_name", "arguments"}`` merged)."""
    calls = message.get("tool_calls") or []
    if calls:
        fn = calls[0]["function"]
        return {"tool_name": fn["name"], **json.loads(fn.get("arguments") or "{}")}
    return {"message": message.get("content") or ""}


@register
@dataclass
class OpenEnvConfig(EpisodeSettings):
    """OpenEnv servers (running, or started from an app), how observations become messages and
    answers become actions, and how an episode's rewards add up."""

    env_urls: list[str] = field(default_factory=list)  # servers already running (http://host:port)
    env_app: str = ""  # or servers the run starts: an ASGI app by import path, e.g. "my_env.server:app"
    n_envs: int = field(default=1, metadata=at_least(1))  # servers the run starts from env_app: env-<i>
    max_replacements: int = field(default=3, metadata=at_least(0))  # a started server's, when it dies
    max_turns: int = field(default=8, metadata=at_least(1))  # steps per episode when it is not done before
    reward: Literal["sum", "last"] = "sum"  # the episode's reward: its step rewards summed, or the last
    reset_args: dict[str, Any] = field(default_factory=dict)  # passed to reset (an item's "reset" adds)
    # fn(observation: dict, turn: int) -> the messages it adds to the conversation
    render: str = "nodes.rollout.environments.openenv_env:default_messages"
    # fn(message: dict (the assistant's, OpenAI's shape), observation: dict) -> the action (a dict)
    action: str = "nodes.rollout.environments.openenv_env:default_action"
    system_prompt: str = ""  # the conversation's first message; "": none
    start_timeout_s: float = field(default=120.0, metadata=above(0))  # a started server's first /health

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.env_urls) == bool(self.env_app):
            raise ValueError(
                "'env_urls' or 'env_app' (one of them) must name the OpenEnv servers: running ones "
                '(env_urls = ["http://127.0.0.1:8000"]) or an app the run starts (env_app = "module:app")'
            )
        for key in ("render", "action"):
            resolve(getattr(self, key), f"rollout.workflow_args.{key}")
        if self.env_app:
            _importable_app(self.env_app)
        for url in self.env_urls:
            if (why := _health(url)) is not None:
                raise ValueError(f"'env_urls' entry {url!r} does not answer: {why}; start it or fix the URL")


def _importable_app(path: str) -> None:
    """``env_app`` imports (in this process: the servers import it again in theirs)."""
    if ":" not in path:
        raise ValueError(f"'env_app' must be an import path 'module:app', got {path!r}")
    try:
        resolve(path, "rollout.workflow_args.env_app")
    except ValueError as e:
        raise ValueError(f"'env_app' = {path!r}: {str(e).split(': ', 1)[-1]}") from None


def _health(url: str) -> str | None:
    """None when ``url``'s ``/health`` answers 200, else why not (one line). Blocking."""
    import httpx  # one blocking /health probe of an environment server, not the inference wire

    try:
        r = httpx.get(url.rstrip("/") + "/health", timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    return None if r.status_code == 200 else f"/health answered {r.status_code}"


class OpenEnvWorkflow:
    """Runs ``n_samples`` episodes per item against OpenEnv servers; the environment's rewards."""

    config_class: ClassVar[type] = OpenEnvConfig

    @staticmethod
    async def start_actors(cluster: rlactors.Cluster, config: OpenEnvConfig) -> None:
        """Before the rollout actors: the run's servers of ``env_app`` (none for ``env_urls``)."""
        if config.env_app:
            await start_env_servers(cluster, config)

    def __init__(self, tokenizer: Any, reward: RewardRunner, config: OpenEnvConfig | None = None) -> None:
        self.config = c = config or OpenEnvConfig()
        self.render = resolve(c.render, "rollout.workflow_args.render")
        self.to_action = resolve(c.action, "rollout.workflow_args.action")
        self.servers = EnvServers(c)
        self.episodes = EnvEpisodes(tokenizer, c, c.env_app or ",".join(c.env_urls))
        self.counters = self.episodes.counters

    async def arun_episode(self, client: Any, item: Any, group_id: str | None = None) -> TrajectoryGroup:
        """``n_samples`` episodes of the environment, one session each; one group."""
        gid = group_id or uuid.uuid4().hex
        trajs = await self.episodes.guard(
            all_or_none(self._episode(client, item, gid) for _ in range(self.config.n_samples)), gid
        )
        trajs = [t for ts in trajs for t in ts]
        if not trajs:
            raise EnvError(
                f"environment {self.episodes.env_name}: no completion in any episode of group {gid}"
            )
        return TrajectoryGroup(gid, trajs)

    async def _episode(self, client: Any, item: Any, gid: str) -> list[Any]:
        from openenv.core import GenericEnvClient

        c = self.config
        server = await self.servers.pick()
        env = GenericEnvClient(base_url=server, message_timeout_s=c.episode_timeout_s)
        try:
            return await self._steps(client, item, gid, env)
        except BaseException:  # any exit marks the server failed, then re-raises
            self.servers.failed(server)  # replaced, perhaps: ask its actor again for the next episode
            raise

    async def _steps(self, client: Any, item: Any, gid: str, env: Any) -> list[Any]:
        c = self.config
        async with self.episodes.episode(client) as (ep, url):
            sdk = sdk_client(url)
            try:
                rewards = []
                reset = {**c.reset_args, **((item.get("reset") or {}) if isinstance(item, dict) else {})}
                result = await env.reset(**reset)
                messages = [{"role": "system", "content": c.system_prompt}] if c.system_prompt else []
                for turn in range(c.max_turns):
                    messages += self.render(result.observation, turn)
                    r = await sdk.chat.completions.create(model=c.model_name, messages=messages)
                    msg = r.choices[0].message
                    answer: dict[str, Any] = {"role": "assistant", "content": msg.content}
                    if msg.tool_calls:
                        answer["tool_calls"] = [t.model_dump(exclude_none=True) for t in msg.tool_calls]
                    messages.append(answer)
                    result = await env.step(self.to_action(answer, result.observation))
                    if result.reward is not None:
                        rewards.append(
                            finite_reward(result.reward, f"environment {self.episodes.env_name}'s reward")
                        )
                    if result.done:
                        break
            finally:
                await sdk.close()
                await env.close()
            total = sum(rewards) if c.reward == "sum" else (rewards[-1] if rewards else 0.0)
            info = {"turns": float(ep.counters["calls"]), "env_reward_steps": float(len(rewards))}
            return self.episodes.trajectories(ep, total, gid, info)
