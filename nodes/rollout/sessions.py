"""Online mode: episodes from agents outside the cluster, over an authenticated session API.

``[data] source = "online"`` with ``[rollout] workflow = "nodes.rollout.sessions:OnlineWorkflow"``.
Each rollout actor then serves, beside its OpenAI-compatible endpoint (nodes/rollout/openai_endpoint.py),
the session API, behind the run's key (the servers' ``--api-key``: ``Authorization: Bearer <key>``)::

    POST /rl/v1/sessions                {"task_id"?: str, "group"?: int}
         -> 200 {"id", "task_id", "group_id", "base_url"}     429 + Retry-After: not admitting now
    (chat completions, responses or Anthropic messages at base_url: any number of turns, token-exact
     as any episode's; the Anthropic SDK takes base_url without its /v1 and sends the key as x-api-key)
    POST /rl/v1/sessions/{id}/reward    {"reward": number}
         -> 200 {"id", "task_id", "group_id", "reward", "trajectories"}   the session has ended

Admission is the governor's as for any episode: each episode the rollout actor admits is a *slot*, a
GRPO group waiting for a task. A session whose ``task_id`` has an open group with room joins it;
otherwise it takes the oldest free slot, and with none free (the staleness bound, the concurrency
limit) or while the servers are paused for a weight push, the API answers 429 with ``Retry-After``.
Sessions with the same ``task_id`` form one group of ``n_samples`` (or the ``group`` its first session
asks for); a task without an id gets one, returned for its other sessions to name. The group is
trained once every session has been rewarded or dropped. A group that does not fill within
``group_timeout_s`` of its first session is trained as it is, or dropped (``partial_groups``); a
session never rewarded within ``session_timeout_s`` is dropped; each is counted. A session's
completions generate through the rollout actor's client, so a weight push aborts and resumes them
as any episode's, and its tokens carry their policy versions.

The API binds ``host`` (loopback by default) and ``port`` (0: a free one); the run writes the URLs
and the key to ``<run.out_dir>/sessions.json`` (mode 600). TLS is a reverse proxy's job in front of
it (``public_url`` is then the address clients are given): see docs/tutorials/online.md.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import orjson
import structlog

from nodes.rollout.http1 import HTTPLimits, Request, Response
from nodes.rollout.http1.server import COUNTERS as HTTP_COUNTERS
from nodes.rollout.openai_endpoint import ChatEndpoint, EndpointError, Episode
from nodes.rollout.reward import RewardRunner
from protocols.rl import TrajectoryGroup
from protocols.runtime.codec import register
from rlactors.base.tomlconf import above, at_least, check_ranges

__all__ = ["SESSIONS_KV", "OnlineConfig", "OnlineError", "OnlineWorkflow", "SessionAPI"]

log = structlog.get_logger(__name__)

SESSIONS_KV = "online/sessions"  # <SESSIONS_KV>/<rollout actor's name> -> its session API's URL
PREFIX = "/rl/v1/sessions"
MAX_TASK_ID = 256  # characters


class OnlineError(RuntimeError):
    """A group of sessions that cannot be trained (dropped, or nothing rewarded): its slot is
    given back."""


@register
@dataclass
class OnlineConfig:
    """``[rollout.workflow_args]`` of online mode: groups of sessions, their timeouts, where the API listens."""

    n_samples: int = field(default=4, metadata=at_least(1))  # sessions per task_id: one GRPO group
    # a group that has not filled this long after its first session: train it as it is, or drop it
    group_timeout_s: float = field(default=300.0, metadata=above(0))
    partial_groups: Literal["train", "drop"] = "train"  # what a group that timed out unfilled becomes
    # a session not rewarded this long after it opened is dropped (its group goes on without it)
    session_timeout_s: float = field(default=600.0, metadata=above(0))
    host: str = "127.0.0.1"  # the session API's bind address (loopback: only this host's clients)
    # the session API's port; 0: a free one (<run.out_dir>/sessions.json names it); a fixed one
    # needs rollout.n_actors = 1
    port: int = field(default=0, metadata=at_least(0))
    # the address clients are given ("": http://host:port); e.g. a TLS reverse proxy's https://...
    public_url: str = ""
    # the Retry-After (seconds) of a 429: while nothing is admitted or the servers are paused
    retry_after_s: int = field(default=1, metadata=at_least(1))
    # a completion's token limit when the client's request does not say
    max_new_tokens: int = field(default=256, metadata=at_least(1))
    # a completion's temperature when the client's request does not say; 0 = greedy
    temperature: float = field(default=1.0, metadata=at_least(0))
    model_name: str = "policy"  # what /v1/models lists; any name is accepted in requests
    tool_parser: str = "hermes"  # how tool calls are read: hermes (= qwen25), or module:fn
    # the bounds of the API's HTTP server, which faces clients outside the cluster (request sizes,
    # deadlines, connections; the table: docs/operate/http-limits.md)
    http: HTTPLimits = field(default_factory=HTTPLimits)

    def __post_init__(self) -> None:
        check_ranges(self)

    def online_data(self, data: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str, str]:
        """``[data] source = "online"`` (nodes/driver/data.py): one placeholder item, repeated for ever (each
        admitted episode is a slot for a group of sessions), and nothing held out."""
        return [{}], [], "online: episodes from the session API's clients", "none (online mode)"


@dataclass
class Session:
    """One client's episode: its turns (``episode``), then its reward, or dropped (``reward`` None)."""

    id: str
    group: Group
    episode: Episode
    timer: asyncio.TimerHandle | None = None
    reward: float | None = None
    ended: bool = False


@dataclass
class Group:
    """An admitted episode (a slot): the sessions of one task, trained together."""

    id: str  # the rollout actor's group id
    client: Any  # the rollout actor's client: the sessions' completions generate through it
    task_id: str = ""
    size: int = 0  # 0: no task yet
    sessions: list[Session] = field(default_factory=list)
    closed: bool = False  # takes no more sessions (full, or timed out)
    dropped: bool = False
    timer: asyncio.TimerHandle | None = None
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def settle(self) -> None:
        """Done once closed and every session ended."""
        if self.closed and all(s.ended for s in self.sessions) and not self.done.done():
            self.done.set_result(None)


class SessionAPI:
    """The session API on a :class:`ChatEndpoint` (mounted at ``/rl/v1/sessions``)."""

    def __init__(self, endpoint: ChatEndpoint, config: OnlineConfig, counters: dict[str, int]) -> None:
        self.endpoint, self.config, self.counters = endpoint, config, counters
        self.slots: deque[Group] = deque()  # admitted, no task yet: oldest first
        self.open: dict[str, Group] = {}  # task_id -> its group while it takes sessions
        self.sessions: dict[str, Session] = {}
        endpoint.mount(PREFIX, self.handle)

    @property
    def base(self) -> str:
        """The root URL clients are given: ``public_url`` (a reverse proxy), else where it listens."""
        return self.config.public_url.rstrip("/") or self.endpoint.url

    # -- slots (the workflow's side) -----------------------------------------------------------

    def offer(self, group: Group) -> None:
        """An admitted episode waits for a task: the newest slot, taken after the older ones."""
        self.slots.append(group)

    def withdraw(self, group: Group) -> None:
        """The slot's episode ended (or was cancelled): nothing of the group stays served."""
        if group in self.slots:
            self.slots.remove(group)
        if self.open.get(group.task_id) is group:
            del self.open[group.task_id]
        if group.timer is not None:
            group.timer.cancel()
        for s in group.sessions:
            self._end(s)

    # -- routes --------------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        """``POST /rl/v1/sessions`` and ``POST /rl/v1/sessions/{id}/reward`` (the endpoint checked the key)."""
        path = request.path.rstrip("/")
        if path == PREFIX:
            _method(request, "POST")
            return self._create(_body(request))
        sid, _, action = path[len(PREFIX) + 1 :].partition("/")
        if action == "reward":
            _method(request, "POST")
            return self._reward(sid, _body(request))
        raise EndpointError(404, f"{request.method} {request.path}: Not Found")

    def _create(self, body: dict[str, Any]) -> Response:
        task_id, size = body.get("task_id"), body.get("group")
        if task_id is not None and (not isinstance(task_id, str) or not 0 < len(task_id) <= MAX_TASK_ID):
            raise EndpointError(400, f"task_id: a string of 1 to {MAX_TASK_ID} characters", "task_id")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise EndpointError(
                400, "group: the number of sessions in this task's group (an integer >= 1)", "group"
            )
        group = self.open.get(task_id) if task_id else None
        admitting = group or (self.slots[0] if self.slots else None)
        if admitting is None or admitting.client.paused:  # nothing admitted, or a weight push
            self.counters["sessions_refused"] += 1
            err = EndpointError(
                429,
                "the run is not admitting sessions now: retry after Retry-After seconds",
                code="not_admitting",
            )
            err.headers["Retry-After"] = str(self.config.retry_after_s)
            raise err
        if group is None:  # the oldest slot: consumption follows admission order
            group = self.slots.popleft()
            group.task_id = task_id or uuid.uuid4().hex
            group.size = size or self.config.n_samples
            self.open[group.task_id] = group
            group.timer = asyncio.get_running_loop().call_later(
                self.config.group_timeout_s, self._expire_group, group
            )
        episode, _ = self.endpoint.open_episode(client=group.client)
        session = Session(episode.id, group, episode)
        session.timer = asyncio.get_running_loop().call_later(
            self.config.session_timeout_s, self._expire_session, session
        )
        group.sessions.append(session)
        self.sessions[session.id] = session
        self.counters["sessions_opened"] += 1
        if len(group.sessions) >= group.size:
            self._close(group)
        return _json(
            {
                "id": session.id,
                "task_id": group.task_id,
                "group_id": group.id,
                "base_url": f"{self.base}/episodes/{session.id}/v1",
            }
        )

    def _reward(self, sid: str, body: dict[str, Any]) -> Response:
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EndpointError(400, "reward: a finite number", "reward")
        session = self.sessions.get(sid)
        if session is None:
            raise EndpointError(
                404,
                f"no session {sid!r} is open here (ended, timed out, or never opened)",
                code="session_not_found",
            )
        if session.episode.inflight:  # its sequence is still growing: reward what it will be
            raise EndpointError(
                409,
                "a completion of this session is still running: post the reward after its answer",
                code="session_busy",
            )
        session.reward = float(reward)
        self.counters["sessions_rewarded"] += 1
        self._end(session)
        n = sum(1 for s in session.episode.samples if s.mask.any())
        return _json(
            {
                "id": sid,
                "task_id": session.group.task_id,
                "group_id": session.group.id,
                "reward": session.reward,
                "trajectories": n,
            }
        )

    # -- ends ----------------------------------------------------------------------------------

    def _end(self, session: Session) -> None:
        if session.ended:
            return
        session.ended = True
        if session.timer is not None:
            session.timer.cancel()
        self.sessions.pop(session.id, None)
        self.endpoint.episodes.pop(session.id, None)
        session.group.settle()

    def _close(self, group: Group) -> None:
        group.closed = True
        if self.open.get(group.task_id) is group:
            del self.open[group.task_id]
        if group.timer is not None:
            group.timer.cancel()
        group.settle()

    def _expire_session(self, session: Session) -> None:
        if not session.ended:
            self.counters["sessions_timed_out"] += 1
            log.info("online.session_timed_out", session=session.id, task=session.group.task_id)
            self._end(session)

    def _expire_group(self, group: Group) -> None:
        if group.closed:
            return
        self.counters["groups_partial"] += 1
        if self.config.partial_groups == "drop":
            self.counters["groups_dropped"] += 1
            group.dropped = True
            for s in group.sessions:
                self._end(s)
        log.info(
            "online.group_timed_out",
            group=group.id,
            task=group.task_id,
            sessions=len(group.sessions),
            size=group.size,
            dropped=group.dropped,
        )
        self._close(group)


class OnlineWorkflow:
    """Each admitted episode is a slot for one group of the session API's sessions (module docstring)."""

    config_class: ClassVar[type] = OnlineConfig

    def __init__(self, tokenizer: Any, reward: RewardRunner, config: OnlineConfig | None = None) -> None:
        self.tokenizer, self.config = tokenizer, config or OnlineConfig()
        self.counters = dict.fromkeys(
            (
                "sessions_opened",
                "sessions_rewarded",
                "sessions_timed_out",
                "sessions_refused",
                "groups_partial",
                "groups_dropped",
                "history_edits",
                # the API's HTTP server's refusals (nodes/rollout/http1/server.py)
                "http_slow_clients",
                "http_refused_connections",
                "http_bad_requests",
                "http_unauthorized",
                "http_stalled_readers",
            ),
            0,
        )
        assert set(HTTP_COUNTERS) <= set(self.counters)
        self.api: SessionAPI | None = None
        self._started: asyncio.Future[SessionAPI] | None = None

    async def start(self, client: Any, api_key: str | None = None) -> SessionAPI:
        """The session API, started once (by the first episode; the others wait for the same start),
        behind ``api_key`` (default: the key of the servers ``client`` talks to, the run's)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start(client, api_key))
        return await asyncio.shield(self._started)

    async def _start(self, client: Any, api_key: str | None) -> SessionAPI:
        c = self.config
        key = api_key if api_key is not None else getattr(getattr(client, "config", None), "keys", None)
        key = getattr(key, "api_key", key) or ""
        endpoint = ChatEndpoint(
            None,
            self.tokenizer,
            c.model_name,
            default_max_tokens=c.max_new_tokens,
            default_temperature=c.temperature,
            tool_parser=c.tool_parser,
            api_key=key,
            limits=c.http,
            counters=self.counters,
        )
        api = SessionAPI(endpoint, c, self.counters)
        await endpoint.start(c.host, c.port)
        self.api = api
        await _announce(api.base)
        log.info("online.serving", url=f"{api.base}{PREFIX}", keyed=bool(key))
        return api

    async def aclose(self) -> None:
        if self.api is not None:
            await self.api.endpoint.aclose()

    async def arun_episode(self, client: Any, item: Any, group_id: str | None = None) -> TrajectoryGroup:
        """Wait for a task's sessions to take this slot and end; their trajectories as one group."""
        api = await self.start(client)
        group = Group(group_id or uuid.uuid4().hex, client)
        api.offer(group)
        try:
            await group.done  # no timeout: a slot waits for clients; once taken, the group's timers end it
        finally:
            api.withdraw(group)
        if group.dropped:
            raise OnlineError(
                f"group {group.id} (task {group.task_id}): not filled within group_timeout_s, dropped"
            )
        trajs = []
        for s in group.sessions:
            if s.reward is None:
                continue
            self.counters["history_edits"] += max(0, s.episode.counters["new_samples"] - 1)
            trajs += s.episode.trajectories(
                s.reward, group.id, session=s.id, task_id=group.task_id, turns=s.episode.counters["calls"]
            )
        if not trajs:
            raise OnlineError(
                f"group {group.id} (task {group.task_id}): no rewarded session made a completion"
            )
        return TrajectoryGroup(group.id, trajs)


async def _announce(url: str) -> None:
    """Inside a rollout actor: put the API's URL where the driver reads it (:data:`SESSIONS_KV`)."""
    import rlactors

    try:
        ctx = rlactors.get_context()
    except rlactors.ClusterError:  # not in an actor (a test, a benchmark)
        return
    await ctx.cluster.kv_put(f"{SESSIONS_KV}/{ctx.name}", url)


async def session_urls(cluster: Any, names: list[str], timeout: float) -> list[str]:
    """The session APIs' URLs the rollout actors ``names`` announced (each waited for up to ``timeout``)."""
    return [f"{await cluster.kv_get(f'{SESSIONS_KV}/{n}', wait=timeout)}{PREFIX}" for n in names]


def _method(request: Request, allowed: str) -> None:
    if request.method != allowed:
        raise EndpointError(405, f"{request.method} {request.path}: Method Not Allowed")


def _body(request: Request) -> dict[str, Any]:
    if not request.body:
        return {}
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError as e:
        raise EndpointError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise EndpointError(400, "the request body must be a JSON object")
    return body


def _json(obj: Any) -> Response:
    return Response(200, orjson.dumps(obj))
