"""What every environment workflow shares: the per-episode OpenAI-compatible endpoint its rollouts
talk to, turning an episode's token sequences into trajectories, and how a failing environment is
counted, logged and dropped.

Each sample of an item runs in its own episode on the rollout actor's endpoint
(nodes/rollout/openai_endpoint.py), exactly as an agent's run does (nodes/rollout/agents.py): the
environment's model calls are chat completions (or responses, or Anthropic messages: the same
episode's ``/v1/messages``) against the episode's ``base_url``, and the endpoint
keeps them as token sequences, a later turn continuing the earlier turn's ids, the model's tokens
under the loss mask. An environment that raises, returns a reward that is not a finite number, or
runs past ``episode_timeout_s`` drops the item's group: counted (``rollout/env_errors``,
``rollout/env_timeouts``), logged once per distinct failure with the environment's name, and the
run goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog

from nodes.rollout import agent_runner
from nodes.rollout.http1 import Request, Response
from nodes.rollout.openai_endpoint import ChatEndpoint, EndpointError, Episode
from protocols.rl import Trajectory
from rlactors.base.tomlconf import above, at_least, check_ranges

__all__ = ["EnvEpisodes", "EnvError", "EpisodeSettings", "finite_reward", "sdk_client"]

log = structlog.get_logger(__name__)

SESSIONS = "/sessions/"  # sessions(): the endpoint's paths that split a run by X-Session-ID


class EnvError(RuntimeError):
    """An environment's episode failed (it raised, timed out, or scored no finite number): the
    item's group is dropped."""


@dataclass
class EpisodeSettings:
    """How an environment's episodes run: samples per item, their time limit, the completions'
    defaults when the environment's requests do not say."""

    n_samples: int = field(default=4, metadata=at_least(1))  # episodes per item: one GRPO group
    episode_timeout_s: float = field(default=300.0, metadata=above(0))  # one episode, scoring included
    # a completion's token limit when the environment's request does not say
    max_new_tokens: int = field(default=256, metadata=at_least(1))
    # a completion's temperature when the environment's request does not say; 0 = greedy
    temperature: float = field(default=1.0, metadata=at_least(0))
    model_name: str = "policy"  # the model name the environment's requests carry
    tool_parser: str = "hermes"  # how tool calls are read from the output: hermes (= qwen25), or module:fn

    def __post_init__(self) -> None:
        check_ranges(self)


def finite_reward(value: Any, what: str) -> float:
    """``value`` as a float, or :class:`EnvError` naming ``what`` when it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EnvError(f"{what} is {value!r}, not a finite number")
    return float(value)


def sdk_client(url: str, sdk: str = "openai") -> Any:
    """A client on an episode's base_url, as an agent's (nodes/rollout/agent_runner.py):
    ``openai.AsyncOpenAI``, or ``anthropic.AsyncAnthropic`` (``sdk = "anthropic"``: the episode's
    Messages API), with no TLS to the endpoint (loading certificates is most of an episode's CPU
    otherwise)."""
    return agent_runner.sdk_client(url, sdk)


class EnvEpisodes:
    """The endpoint an environment workflow's episodes run on, its counters and its failure log."""

    def __init__(self, tokenizer: Any, settings: EpisodeSettings, env_name: str) -> None:
        s = settings
        self.settings, self.env_name = s, env_name
        # one endpoint for the workflow's episodes, whichever client generates (the rollout actor's,
        # an evaluation's); started by the first episode, on its loop
        self.endpoint = ChatEndpoint(
            None,
            tokenizer,
            s.model_name,
            default_max_tokens=s.max_new_tokens,
            default_temperature=s.temperature,
            tool_parser=s.tool_parser,
        )
        self._started: asyncio.Future[str] | None = None
        self._routes: dict[
            str, tuple[Any, dict[str, Episode]]
        ] = {}  # sessions(): run -> its client, episodes
        self.counters = dict.fromkeys(("env_episodes", "env_errors", "env_timeouts", "history_edits"), 0)
        self._logged: set[str] = set()

    async def _start(self) -> None:
        if self._started is None:  # the first episode starts it; the others wait for the same start
            self._started = asyncio.ensure_future(self.endpoint.start())
        await asyncio.shield(self._started)

    @asynccontextmanager
    async def episode(self, client: Any) -> AsyncIterator[tuple[Episode, str]]:
        """A new episode generating through ``client``, and its ``base_url`` (``.../v1``)."""
        await self._start()
        ep, url = self.endpoint.open_episode(client=client)
        self.counters["env_episodes"] += 1
        try:
            yield ep, url
        finally:
            self.endpoint.close_episode(ep.id)

    @asynccontextmanager
    async def sessions(self, client: Any) -> AsyncIterator[tuple[dict[str, Episode], str]]:
        """A base_url (``.../v1``) whose requests make one episode per ``X-Session-ID`` they carry (a
        verifiers v1 episode's agents each send their trace's id), and those episodes by that id,
        generating through ``client``."""
        await self._start()
        if not self._routes:
            self.endpoint.mount(SESSIONS, self._route)
        run = uuid.uuid4().hex
        self._routes[run] = (client, {})
        try:
            yield self._routes[run][1], f"{self.endpoint.url}{SESSIONS}{run}/v1"
        finally:
            _, eps = self._routes.pop(run)
            for ep in eps.values():
                self.endpoint.close_episode(ep.id)

    async def _route(self, request: Request) -> Response | None:
        """``/sessions/<run>/v1/...``: the request served as its session's episode's."""
        run, _, rest = request.path[len(SESSIONS) :].partition("/")
        if run not in self._routes:
            return EndpointError(404, f"no run {run!r} is open here", code="episode_not_found").response()
        client, eps = self._routes[run]
        sid = request.headers.get("x-session-id", "")
        if sid not in eps:
            eps[sid] = self.endpoint.open_episode(client=client)[0]
            self.counters["env_episodes"] += 1
        # the endpoint's own routing, as the episode's base_url would reach it
        return await self.endpoint._handle(
            dataclasses.replace(request, path=f"/episodes/{eps[sid].id}/{rest}")
        )

    async def guard(self, aw: Any, gid: str) -> Any:
        """Await ``aw`` (one item's episodes and their scoring) within ``n_samples`` episode timeouts
        run concurrently (one ``episode_timeout_s``); a failure is counted, logged once, and raised
        as :class:`EnvError` (the rollout actor drops the group and goes on)."""
        limit = self.settings.episode_timeout_s
        try:
            async with asyncio.timeout(limit):
                return await aw
        except TimeoutError:
            self.counters["env_timeouts"] += 1
            self._log_once(f"ran past episode_timeout_s = {limit}s", gid)
            raise EnvError(f"environment {self.env_name} ran past {limit}s") from None
        except Exception as e:  # an environment's code: whatever it raises fails its episode
            self.counters["env_errors"] += 1
            why = str(e) if isinstance(e, EnvError) else f"raised {type(e).__name__}: {e}"
            self._log_once(why, gid, e)
            raise e if isinstance(e, EnvError) else EnvError(f"environment {self.env_name} {why}") from e

    def _log_once(self, why: str, gid: str, exc: BaseException | None = None) -> None:
        """A warning the first time a failure happens; the counters count the repeats."""
        key = why.split("\n", 1)[0][:200]
        if key in self._logged:
            return
        self._logged.add(key)
        log.warning("env.failed", env=self.env_name, group=gid, error=key, exc_info=exc)

    def trajectories(self, ep: Episode, reward: float, gid: str, info: dict[str, float]) -> list[Trajectory]:
        """The episode's token sequences as trajectories, each with ``reward``; ``info`` reaches the
        metrics as ``episode/<name>``. An episode whose model edited its history is several."""
        self.counters["history_edits"] += max(0, ep.counters["new_samples"] - 1)
        return ep.trajectories(
            reward, gid, turns=ep.counters["calls"], tool_calls=ep.counters["tool_calls"], info=info
        )
