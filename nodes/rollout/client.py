"""SGLang HTTP client for rollout: interruptible generation, sticky routing, retries and failover.

``agenerate`` posts ``/generate`` and, while the answer is an abort (the trainer paused the
servers to push weights) and token budget remains, appends what came back to the input,
lowers ``max_new_tokens`` and re-posts to the *same* server, so the prefix is served from
that server's radix cache. The answer's tokens, log-probs and versions come out as numpy arrays, each
made in one pass over what the JSON parser read (nodes/rollout/chunks.py), and a resumed request's
chunks are concatenated. Every output token is stamped with a policy version (see
:func:`nodes.rollout.chunks.token_versions`): the server's own per-token label when it sends one (the reference
server does; it is exact when a request was held across a weight update by a ``retract`` or
``in_place`` pause), else the version the client knew when it posted the chunk.

Compared with AReaL's client: keep-alive connections to each server (our pools over httptools'
parser, nodes/rollout/pool.py; bodies encoded and decoded with orjson); a resumed request waits on a future that :meth:`SGLangClient.resume`
completes instead of polling a flag, woken one server at a time in turn so that every server gets
its first re-post within the first lap; a request id is sent (and a rid reused across an
episode's turns keeps the episode on one server); new requests go to the least-loaded healthy
server; a server that keeps failing is marked down and the request moves, with its tokens so far,
elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import structlog

from nodes.common.trace import TRACE
from nodes.rollout.chunks import (
    GenerationError,
    StreamedChunk,
    TokensCallback,
    parse_chunk,
    resume_params,
    token_versions,
)
from nodes.rollout.config import ClientConfig
from nodes.rollout.pool import ServerPool, Wire, WireError
from protocols.http.sglang import AbortRequest, GenerateBody, lora_name, request_body
from rlactors.base.aio import wait_for
from rlactors.base.forensics import waiting
from rlactors.base.logging import Throttle

__all__ = [
    "ClientConfig",
    "GenRequest",
    "GenResult",
    "GenerationError",
    "NoServerAvailableError",
    "SGLangClient",
]

log = structlog.get_logger(__name__)
# a request held over a pause, as cluster.stacks() labels it (rlactors.base.forensics.waiting)
PAUSED_BY_DESIGN = "requests held while the trainer pushes weights"


class NoServerAvailableError(GenerationError):
    """Every server failed this request after retries; the request cannot make progress."""


@dataclass
class GenRequest:
    """One generation: prompt ids (a list or a numpy array), SGLang sampling params, and an optional
    request id.

    Reusing ``rid`` across the turns of an episode keeps the episode on one server.
    """

    input_ids: Sequence[int]
    sampling_params: dict[str, Any] = field(default_factory=dict)
    rid: str | None = None
    top_logprobs_num: int = 0  # > 0: also the most likely tokens at each output position
    trace_id: str | None = None  # the trajectory's, on this request's span in the run's timeline
    # set: posts stream, and each batch of new tokens is handed to it as it arrives (across
    # aborts, resumes and failovers, every token once, in order)
    on_tokens: TokensCallback | None = None


class _AsList:
    """One of :class:`GenResult`'s arrays read as a list: made on first read and kept while the array
    is the same object; assigning a sequence (``res.output_ids = ...``, or ``+=``) sets the array."""

    def __init__(self, array: str, dtype: type) -> None:
        self.array, self.dtype = array, dtype

    def __set_name__(self, owner: type, name: str) -> None:
        self.kept = f"_{name}"  # where an instance keeps (its array, the list made of it)

    def __get__(self, res: Any, owner: type | None = None) -> Any:
        if res is None:
            return self
        array = getattr(res, self.array)
        kept = res.__dict__.get(self.kept)
        if kept is None or kept[0] is not array:
            kept = res.__dict__[self.kept] = (array, array.tolist())
        return kept[1]

    def __set__(self, res: Any, values: Sequence[Any]) -> None:
        array: np.ndarray = np.asarray(values, dtype=self.dtype)
        setattr(res, self.array, array)
        res.__dict__[self.kept] = (array, values if isinstance(values, list) else array.tolist())


@dataclass
class GenResult:
    """The output of one request, assembled over every abort/resume and failover.

    The output tokens are numpy arrays, made once from the server's answers: ``ids`` (int32),
    ``logprobs`` (float64, as the server sent them) and ``versions`` (int32, the policy version of
    each token), so a workflow concatenates them into its trajectory with no step per token.
    ``output_ids``, ``output_logprobs`` and ``output_versions`` are the same as lists, made on first
    read, for code that reads lists; assigning one (``=`` or ``+=``) sets its array. Built by hand (a
    test's scripted client), the three arrays may be given as lists.
    """

    rid: str
    ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str  # "stop" | "length" | "abort" (abort only when the budget ran out mid-abort)
    text: str
    prompt_tokens: int
    cached_tokens: list[int]  # per post: prefix tokens the server served from its cache
    server: str
    posts: int = 1
    aborts: int = 0
    failovers: int = 0
    weight_version: str | None = None
    matched_stop: Any = None
    # with GenRequest.top_logprobs_num: per output token, [(logprob, token id), ...] most likely first
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int32)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float64)
        self.versions = np.asarray(self.versions, dtype=np.int32)

    output_ids = _AsList("ids", np.int32)
    """``ids`` as a list of ints."""
    output_logprobs = _AsList("logprobs", np.float64)
    """``logprobs`` as a list of floats."""
    output_versions = _AsList("versions", np.int32)
    """``versions`` as a list of ints."""


class SGLangClient:
    """Client for a set of SGLang-protocol servers; one per rollout actor, shared by its episodes."""

    def __init__(
        self,
        urls: list[str],
        config: ClientConfig | None = None,
        version: int = 0,
    ) -> None:
        """``urls``: ``http://`` or ``https://`` servers; ``version``: the policy version they hold."""
        if not urls:
            raise ValueError("SGLangClient needs at least one server URL")
        self.config = config or ClientConfig()
        self._wire = Wire(self.config)  # every server's connections
        self._servers = {u.rstrip("/"): ServerPool(u, self.config, self._wire) for u in urls}
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._active: dict[str, str] = {}  # rid -> server, while its request runs
        self._since: dict[str, float] = {}  # rid -> when it started (monotonic), while it runs
        self._paused = False
        # requests held over a pause, per server: resume() wakes them a server at a time, in turn
        self._held: dict[str, deque[asyncio.Future[None]]] = {}
        self._lap_end: asyncio.Future[None] | None = None  # the last of resume()'s first lap
        self._lap_done = asyncio.Event()  # set once the first lap's last request is posting
        self._lap_done.set()
        self._background: set[asyncio.Task] = set()  # best-effort aborts on timed-out servers
        self._retry_log = Throttle(log, "rollout.retry")  # a storm logs one line per interval
        self.version = version
        # per resume(): [when (monotonic), first re-post ms after it, last re-post ms, re-posts,
        # ms until every server with held requests had its first re-post]
        self.reposts: deque[list[float]] = deque(maxlen=256)
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "requests",
                "posts",
                "aborts",
                "resumes",
                "retries",
                "failovers",
                "errors",
                "cached_tokens",
                "prompt_tokens",
                "output_tokens",
                "idle_aborts",
                "labelled_tokens",
            ),
            0,
        )

    # -- control from the rollout actor / trainer ----------------------------------

    def set_version(self, version: int) -> None:
        """The policy version every server now holds (call it only once they all hold it): chunks
        posted from now on are stamped with it where the server does not label its tokens."""
        self.version = max(self.version, version)

    def pause(self) -> None:
        """Hold aborted requests (and new ones) until :meth:`resume`: the servers are being updated."""
        self._paused = True

    def resume(self) -> None:
        """Let held requests re-post at once (no polling delay). They were held in the order their
        abort answers came back, a server's all together; wake them round-robin over the servers
        instead, so the last server does not wait for every other server's re-posts (they all run
        in the next loop turn, in this order)."""
        self.reposts.append([time.monotonic(), 0.0, 0.0, 0, 0.0])
        self._paused = False
        queues, self._held = list(self._held.values()), {}
        self._lap_end = None
        first_lap = True
        while queues:
            for q in queues:
                fut = q.popleft()
                if not fut.done():  # done: its wait timed out or its task was cancelled
                    fut.set_result(None)
                    if first_lap:
                        self._lap_end = fut
            first_lap = False
            queues = [q for q in queues if q]
        if self._lap_end is None:
            self._lap_done.set()
        else:
            self._lap_done.clear()

    async def reposted(self, timeout_s: float = 1.0) -> None:
        """Return once every server that had requests held over the pause has its first one
        posting again (the first lap of :meth:`resume`), or after ``timeout_s``. A caller that
        continues paused servers after this finds each one with work waiting."""
        with contextlib.suppress(TimeoutError):
            await wait_for(self._lap_done.wait(), timeout_s)

    @property
    def paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume`."""
        return self._paused

    @property
    def urls(self) -> list[str]:
        """Server URLs this client routes to."""
        return list(self._servers)

    def server_of(self, rid: str) -> str | None:
        """The server a running request (by its rid) is on, e.g. to abort it there."""
        return self._active.get(rid)

    def waiting(self) -> dict[str, dict[str, float]]:
        """Per server with requests running: how many, and how long the oldest has run (s); what
        a stall watchdog asks (nodes/driver/watchdog.py)."""
        now, out = time.monotonic(), dict[str, dict[str, float]]()
        for rid, url in self._active.items():
            w = out.setdefault(url, {"requests": 0, "oldest_s": 0.0})
            w["requests"] += 1
            w["oldest_s"] = max(w["oldest_s"], now - self._since.get(rid, now))
        return out

    def load(self) -> dict[str, int]:
        """Requests in flight per server, as this client sees them."""
        return {u: s.inflight for u, s in self._servers.items()}

    async def aclose(self) -> None:
        """Cancel background aborts and close every connection."""
        self._retry_log.flush()
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._wire.aclose()

    # -- generation ----------------------------------------------------------------

    async def agenerate(self, request: GenRequest) -> GenResult:
        """Generate to completion across pauses (abort mode), retries and failovers."""
        rid = request.rid or uuid.uuid4().hex
        started = time.time()
        self._since[rid] = time.monotonic()
        sp = dict(request.sampling_params)
        if sp.get("n", 1) != 1:
            raise ValueError("GenRequest: sampling_params.n must be 1; send n requests for n samples")
        budget = 128 if sp.get("max_new_tokens") is None else int(sp["max_new_tokens"])  # SGLang's default
        server = self._route(rid)
        ids, logprobs, versions = np.empty(0, np.int32), np.empty(0, np.float64), np.empty(0, np.int32)
        res = GenResult(
            rid, ids, logprobs, versions, "length", "", len(request.input_ids), [], server.url, posts=0
        )
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(request.input_ids)
        try:
            await self._generate_loop(request, rid, sp, budget, server, res)
        finally:
            self._active.pop(rid, None)
            self._since.pop(rid, None)
        TRACE.async_span(
            "generate",
            f"{rid}#{started}",
            started,
            time.time(),
            f"server {res.server}",
            rid=rid,
            trace_id=request.trace_id,
            prompt_tokens=res.prompt_tokens,
            output_tokens=len(res.ids),
            aborts=res.aborts,
            posts=res.posts,
        )
        return res

    async def _generate_loop(
        self,
        request: GenRequest,
        rid: str,
        sp: dict[str, Any],
        budget: int,
        server: ServerPool,
        res: GenResult,
    ) -> GenResult:
        cfg = self.config
        cached = res.cached_tokens
        texts: list[str] = []
        idle_aborts = 0
        while True:
            if self._paused:
                held = asyncio.get_running_loop().create_future()
                self._held.setdefault(server.url, deque()).append(held)
                try:
                    with waiting("dispatch paused", on="the weight push", backpressure=PAUSED_BY_DESIGN):
                        await wait_for(held, cfg.pause_timeout_s)
                finally:  # (also when cancelled: reposted() must not wait for this one)
                    lap_end = held is self._lap_end
                    if lap_end:
                        self._lap_end = None
                        self._lap_done.set()
                if self.reposts:  # held over a pause: how soon after resume() it goes out
                    r = self.reposts[-1]
                    r[2] = 1e3 * (time.monotonic() - r[0])
                    r[1] = r[1] if r[3] else r[2]
                    r[3] += 1
                    if lap_end:
                        r[4] = r[2]
            posted_at = self.version  # a lower bound on the weights that will sample this chunk
            done = len(res.ids)
            # a resume posts the prompt and the tokens so far
            prefix: Sequence[int] | np.ndarray = request.input_ids
            if done:
                prefix = np.concatenate((np.asarray(prefix, np.int64), res.ids))
            body: GenerateBody = {  # a literal, not a GenerateBody(...) call: built per post
                "input_ids": prefix,
                "sampling_params": resume_params(sp, budget, done),
                "rid": rid if res.posts == 0 else f"{rid}-r{res.posts}",
                "return_logprob": True,
            }
            if request.top_logprobs_num:
                body["top_logprobs_num"] = request.top_logprobs_num
            if cfg.lora and (adapter := lora_name(cfg.lora, posted_at)):
                body["lora_path"] = adapter
            if request.on_tokens is not None:
                body["stream"] = True
            # servers that failed this post; a later post may go back to one that recovered
            data, server = await self._post_with_failover(server, body, set(), res, request.on_tokens)
            res.posts += 1
            chunk_ids, chunk_lps, meta = parse_chunk(data)
            chunk_vers, labelled = token_versions(meta, len(chunk_ids), posted_at)
            if cfg.lora:  # the adapter named is fixed for the whole post: its version is exact
                chunk_vers, labelled = np.full(len(chunk_ids), posted_at, np.int32), 0
            if chunk_vers.size and (oldest := int(chunk_vers.min())) < posted_at:
                log.warning(
                    "rollout.server_behind_client_version",
                    rid=rid,
                    server=server.url,
                    server_version=oldest,
                    client_version=posted_at,
                )
            res.ids = _extend(res.ids, chunk_ids)
            res.logprobs = _extend(res.logprobs, chunk_lps)
            res.versions = _extend(res.versions, chunk_vers)
            if request.top_logprobs_num:
                tops = meta.get("output_top_logprobs") or [[] for _ in range(len(chunk_ids))]
                res.output_top_logprobs += [[(float(e[0]), int(e[1])) for e in row or ()] for row in tops]
            self.counters["labelled_tokens"] += labelled
            texts.append(data.get("text") or "")
            cached.append(int(meta.get("cached_tokens") or 0))
            self.counters["cached_tokens"] += cached[-1]
            self.counters["output_tokens"] += len(chunk_ids)
            res.weight_version = meta.get("weight_version", res.weight_version)
            finish = meta.get("finish_reason") or {}
            kind = finish.get("type") if isinstance(finish, dict) else str(finish)
            if kind != "abort":
                res.finish_reason = kind or "stop"
                res.matched_stop = finish.get("matched") if isinstance(finish, dict) else None
                break
            status = finish.get("status_code") if isinstance(finish, dict) else None
            if status is not None and int(status) >= 400:
                self.counters["errors"] += 1
                raise GenerationError(
                    f"{server.url} aborted request {rid}: {finish.get('message')} ({status})"
                )
            res.aborts += 1
            self.counters["aborts"] += 1
            if len(res.ids) >= budget:
                res.finish_reason = "length"
                break
            idle_aborts = 0 if len(chunk_ids) else idle_aborts + 1
            if idle_aborts > cfg.max_idle_aborts:
                raise GenerationError(
                    f"{server.url} aborted request {rid} {idle_aborts} times without progress"
                )
            if idle_aborts and not self._paused:  # aborted, not for a pause: do not hammer it
                await asyncio.sleep(min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (idle_aborts - 1)))
            self.counters["resumes"] += 1
        res.text = "".join(texts)
        res.server = server.url
        return res

    # -- internals -----------------------------------------------------------------

    def add(self, url: str) -> bool:
        """Start routing to ``url`` (a server that joined: it holds the current version). False if
        it is routed to already."""
        url = url.rstrip("/")
        if url in self._servers:
            return False
        self._servers[url] = ServerPool(url, self.config, self._wire)
        return True

    def retire(self, url: str) -> bool:
        """Stop sending to ``url`` (its server is gone); requests running there fail over. Keeps the last one."""
        url = url.rstrip("/")
        if url not in self._servers or len(self._servers) == 1:
            return False
        del self._servers[url]  # requests still there finish or fail over; connections close in aclose()
        return True

    def _route(self, rid: str) -> ServerPool:
        """The sticky server for ``rid`` if it is healthy, else the least-loaded healthy one."""
        now = time.monotonic()
        url = self._sticky.get(rid)
        if url is not None and url in self._servers and self._servers[url].healthy(now):
            self._sticky.move_to_end(rid)
            server = self._servers[url]
        else:
            server = self._least_loaded(now, exclude=set())
        self._stick(rid, server)
        return server

    def _least_loaded(self, now: float, exclude: set[str]) -> ServerPool:
        candidates = [s for u, s in self._servers.items() if u not in exclude]
        if not candidates:
            raise NoServerAvailableError(f"every server failed: {sorted(exclude)}")
        healthy = [s for s in candidates if s.healthy(now)] or candidates  # all down: try the soonest back
        low = min(s.inflight for s in healthy)
        return random.choice([s for s in healthy if s.inflight == low])

    def _stick(self, rid: str, server: ServerPool) -> None:
        self._sticky[rid] = server.url
        self._sticky.move_to_end(rid)
        while len(self._sticky) > self.config.sticky_entries:
            self._sticky.popitem(last=False)
        self._active[rid] = server.url

    async def _post_with_failover(
        self,
        server: ServerPool,
        body: GenerateBody,
        tried: set[str],
        res: GenResult,
        on_tokens: TokensCallback | None,
    ) -> tuple[dict[str, Any], ServerPool]:
        """POST to ``server`` with retries; if it stays down, move to another (tokens travel in body)."""
        while True:
            try:
                return await self._post_with_retries(server, body, on_tokens), server
            except ServerPoolDown as e:
                server.down_until = time.monotonic() + self.config.down_cooldown_s
                tried.add(server.url)
                nxt = self._least_loaded(time.monotonic(), exclude=tried)  # raises when none left
                log.warning(
                    "rollout.failover",
                    rid=res.rid,
                    frm=server.url,
                    to=nxt.url,
                    tokens=len(res.ids),
                    error=str(e),
                )
                self.counters["failovers"] += 1
                res.failovers += 1
                server = nxt
                self._stick(res.rid, server)

    async def _post_with_retries(
        self, server: ServerPool, body: GenerateBody, on_tokens: TokensCallback | None = None
    ) -> dict[str, Any]:
        cfg = self.config
        last: str = ""
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                self.counters["retries"] += 1
                self._retry_log(server=server.url, attempt=attempt, error=last)
                delay = min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + random.random()))
                body = {**body, "rid": f"{body['rid']}-t{attempt}"}  # never collide with a lingering attempt
            self.counters["posts"] += 1
            server.inflight += 1
            streamed = None if on_tokens is None else StreamedChunk(on_tokens)
            try:
                if streamed is None:
                    status, content = await server.post("/generate", _json(body))
                else:
                    status, content = await server.post_stream("/generate", _json(body), streamed.line)
            except WireError as e:
                last = str(e)
                if e.timed_out:
                    self._spawn(self._abort_quietly(server, body["rid"]))
                if streamed is not None and streamed.ids:  # cut off mid-stream: resume from what came
                    log.warning(
                        "rollout.stream_cut",
                        rid=body["rid"],
                        server=server.url,
                        tokens=len(streamed.ids),
                        error=last,
                    )
                    return streamed.result()
                continue
            finally:
                server.inflight -= 1
            if streamed is not None and status == 200 and not content:  # an event stream, read
                err = streamed.error
                if err is not None and not streamed.ids:  # failed before any token: as a status would
                    code = err.get("code")
                    if isinstance(code, int) and code < 500:
                        self.counters["errors"] += 1
                        raise GenerationError(
                            f"{server.url}/generate failed the stream: {err.get('message')}"
                        )
                    last = f"stream error: {err.get('message')}"
                    continue
                return streamed.result()  # an error after some tokens reads as an abort: resumed
            if status >= 500:
                last = f"HTTP {status}: {_text(content, 200)}"
                continue
            if status != 200:
                self.counters["errors"] += 1
                raise GenerationError(f"{server.url}/generate answered {status}: {_text(content, 500)}")
            try:
                data = orjson.loads(content)
            except orjson.JSONDecodeError:  # a proxy's page, a truncated body: say where it came from
                self.counters["errors"] += 1
                raise GenerationError(
                    f"{server.url}/generate answered 200 with a non-JSON body: {_text(content, 200)!r}"
                ) from None
            if streamed is not None:  # asked to stream, answered whole: the tokens all at once
                streamed.line(b"data: " + content)
                return streamed.result()
            return data
        raise ServerPoolDown(f"{server.url}: {cfg.max_retries + 1} attempts failed, last: {last}")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_quietly(self, server: ServerPool, rid: str) -> None:
        """Best effort: a timed-out request may still run on a hung-but-alive server."""
        with contextlib.suppress(WireError):
            await server.post(
                "/abort_request",
                orjson.dumps(request_body(AbortRequest(rid=rid))),
                timeout=self.config.connect_timeout_s,
            )


class ServerPoolDown(Exception):
    pass


def _extend(have: np.ndarray, more: np.ndarray) -> np.ndarray:
    """``have`` followed by ``more`` (a resumed request's next chunk)."""
    return np.concatenate((have, more)) if have.size else more


def _json(body: GenerateBody) -> bytes:
    """A request body as JSON; its ``input_ids`` may be a numpy array (a workflow's sample)."""
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _text(content: bytes, limit: int) -> str:
    return content[:limit].decode(errors="replace")
