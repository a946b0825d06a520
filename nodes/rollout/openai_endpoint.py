"""An OpenAI-compatible chat endpoint over the rollout plane, so agent code written against the
OpenAI SDK (or any framework that takes a ``base_url``) is trained unchanged.

``/v1/responses`` (OpenAI's Responses API, what the OpenAI Agents SDK calls) is served by the same
turns, token-exact too (nodes/rollout/responses.py).

``/v1/chat/completions`` renders the messages with the model's chat template (tools included,
nodes/rollout/chat.py), generates through an :class:`~nodes.rollout.client.SGLangClient` (aborts and
resumes, sticky routing, per-token policy versions, retries and failover as for any episode), reads
tool calls back from the output (Hermes ``<tool_call>`` blocks) and answers as OpenAI does, streamed
(SSE chunks, tool-call deltas included) or not. ``/v1/models`` lists the model.

Each episode has its own base_url (``/episodes/<id>/v1``; the standalone server's is ``/v1``), and
the endpoint keeps every completion it served there. A request that continues one (its messages are
that completion's messages, the assistant answer it got, then new messages) extends that
completion's exact token ids with the template's rendering of only the new messages: the model's
output is never re-tokenised, and an episode is one token sequence (a :class:`Sample`: numpy arrays
of the trajectory's dtypes, grown by concatenation) whose loss mask covers exactly the model's
tokens. A request that does not continue one (the agent edited its history) starts another sample;
``Episode.counters`` says how often that happened.

Errors are OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) with its status
codes; no request stops the endpoint. Streamed answers go out token by token as the model
generates them (:func:`stream_chat`, below).

Standalone, in front of any SGLang or reference server::

    python -m nodes.rollout.openai_endpoint --server-url http://127.0.0.1:30000 --model-path DIR --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import structlog

from nodes.rollout import chat
from nodes.rollout.chat import ChatError, ToolCall, continuation_ids, prompt_ids
from nodes.rollout.chunks import TokensCallback
from nodes.rollout.client import GenerationError, GenRequest, GenResult
from nodes.rollout.http1 import HTTPServer, Request, Response, Stream
from nodes.rollout.responses import ResponseEvents, ResponseShape, chat_args, new_id, output_items
from nodes.rollout.workflows import Sample
from protocols.auth import ServerKeys
from protocols.openai import ChatCompletionRequest, OpenAIError, ResponsesRequest, error_body
from protocols.rl import IDS_DTYPE, Trajectory

__all__ = ["ChatEndpoint", "EndpointError", "Episode", "Turn"]

log = structlog.get_logger(__name__)

DEFAULT_MAX_TOKENS = 1024
KEPT_COMPLETIONS = 4096  # per episode (the standalone server's one episode keeps the newest)
# Rendering and tokenising up to this many characters of messages runs on the event loop (short
# enough not to hold it up); longer ones go to a thread, so the loop keeps serving. The thread hop
# costs CPU of its own, more than a short render (measured in bench/RESULTS.md, "OpenAI-compatible").
INLINE_RENDER_CHARS = 1024
# First prompts rendered and tokenised, kept by their messages and tools: a GRPO group's episodes
# all open with the same messages, so all but the first of them skip the template and tokenizer
# (measured in bench/RESULTS.md, "OpenAI-compatible")
FIRST_PROMPTS_KEPT = 1024


# what each route serves: [/episodes/<id>]/v1/...
ROUTES = {"/v1/chat/completions": "POST", "/v1/responses": "POST", "/v1/models": "GET"}


class EndpointError(Exception):
    """A request the endpoint refuses: OpenAI's error body with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.type = "invalid_request_error" if status < 500 else "server_error"
        self.headers: dict[str, str] = {}  # e.g. Retry-After on a 429

    def response(self) -> Response:
        out = _json(error_body(str(self), self.type, self.param, self.code), self.status)
        out.headers.update(self.headers)
        return out


# -- requests ------------------------------------------------------------------------------------


@dataclass
class ChatRequest:
    """A checked ``/v1/chat/completions`` body, in the terms the endpoint generates with."""

    messages: list[dict[str, Any]]  # role, content as text, tool_calls, tool_call_id
    tools: list[dict[str, Any]] | None
    tool_choice: Any  # "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    sampling: dict[str, Any]  # SGLang's sampling_params

    @classmethod
    def parse(cls, body: Any, defaults: dict[str, Any]) -> ChatRequest:
        """Check ``body`` (:class:`protocols.openai.ChatCompletionRequest`; 400 naming the field);
        ``defaults`` gives max_new_tokens and temperature when it does not."""
        try:
            req = ChatCompletionRequest.from_json(body)
        except OpenAIError as e:
            raise EndpointError(400, str(e), e.param) from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sampling: dict[str, Any] = {
            "max_new_tokens": defaults["max_new_tokens"] if max_tokens is None else max_tokens,
            "temperature": defaults["temperature"] if req.temperature is None else float(req.temperature),
        }
        for key in ("top_p", "frequency_penalty", "presence_penalty"):
            if (value := getattr(req, key)) is not None:
                sampling[key] = float(value)
        if req.seed is not None:
            sampling["sampling_seed"] = req.seed
        if req.stop is not None:
            sampling["stop"] = req.stop_strings
        options = req.stream_options or {}
        return cls([m.normalized() for m in req.messages], req.tools, req.tool_choice, req.n, bool(req.stream),
                   bool(options.get("include_usage")), bool(req.logprobs), req.top_logprobs, sampling)  # fmt: skip


# -- episodes ------------------------------------------------------------------------------------


@dataclass
class _Completion:
    """One choice the endpoint served: what a later request must repeat to continue it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reply: dict[str, Any]  # the assistant message, as matching compares it
    sample: Sample
    end: int  # len(sample.ids) right after this completion's output
    # the answer's last id (forced ids included; [] for none): what continuation_ids reads of it
    last_id: list[int]
    finish_reason: str


def _reply_key(m: dict[str, Any]) -> tuple[str, tuple[tuple[str, str, str], ...]]:
    """What a sent-back assistant message must repeat of the answer served: content, tool calls."""
    calls = tuple(
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()
    )
    return m.get("content") or "", calls


@dataclass
class Episode:
    """What one agent episode generated: its samples (token sequences) and counters."""

    id: str
    client: Any = None  # what generates its completions (None: the endpoint's client)
    # False (the standalone server's one episode): samples live only as long as their completions
    keep_samples: bool = True
    samples: list[Sample] = field(default_factory=list)
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("calls", "continued", "new_samples", "tool_calls", "errors"), 0
        )
    )
    _completions: OrderedDict[int, _Completion] = field(default_factory=OrderedDict)
    # (number of messages before the answer, _reply_key(answer)) -> numbers of the completions kept:
    # a request is matched against only the completions whose answer it repeats, not all kept
    _by_reply: dict[tuple[int, Any], list[int]] = field(default_factory=dict)
    _next: int = 0
    _sample_count: int = 0
    inflight: int = (
        0  # requests being answered (a session's reward waits for them: nodes/rollout/sessions.py)
    )
    # stored /v1/responses answers (nodes/rollout/responses.py): response id -> its conversation
    responses: OrderedDict[str, list[dict[str, Any]]] = field(default_factory=OrderedDict)

    def trajectories(self, reward: float, group_id: str, **meta: Any) -> list[Trajectory]:
        """Its samples as trajectories rewarded ``reward`` (their meta updated with ``meta``), but
        for a sample with none of the model's tokens (a request that failed): nothing to train on."""
        out = []
        for s in self.samples:
            if s.mask.any():
                s.meta.update(meta)
                out.append(s.trajectory(reward, group_id, int(s.mask.argmax())))  # the model's first token
        return out

    def add_sample(self, s: Sample) -> Sample:
        """Number ``s`` (its request id names it) and keep it when the episode keeps samples."""
        s.meta["rid"] = f"agent/{self.id}/s{self._sample_count}/"
        self._sample_count += 1
        if self.keep_samples:
            self.samples.append(s)
        return s

    def find(
        self, messages: list[dict[str, Any]], tools: Any, temperature: float
    ) -> tuple[_Completion, int] | None:
        """The completion ``messages`` continue (its sample not grown past it, sampled at the same
        temperature), newest first, and where the new messages start."""
        best: tuple[int, _Completion] | None = None
        for k in range(1, len(messages) - 1):  # where the answer would be, with a message after it
            if messages[k]["role"] != "assistant":
                continue
            for n in self._by_reply.get((k, _reply_key(messages[k])), ()):
                c = self._completions[n]
                if (
                    (best is None or n > best[0])
                    and c.tools == tools
                    and c.sample.temperature == temperature
                    and len(c.sample.ids) == c.end
                    and messages[:k] == c.messages
                ):
                    best = n, c
        return None if best is None else (best[1], len(best[1].messages) + 1)

    def keep_response(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        """Keep a stored ``/v1/responses`` answer's conversation (its reply last), for a request
        that names it as ``previous_response_id``."""
        self.responses[response_id] = conversation
        while len(self.responses) > KEPT_COMPLETIONS:
            self.responses.popitem(last=False)

    def keep(self, c: _Completion) -> None:
        self._completions[self._next] = c
        self._by_reply.setdefault((len(c.messages), _reply_key(c.reply)), []).append(self._next)
        self._next += 1
        while len(self._completions) > KEPT_COMPLETIONS:
            n, gone = self._completions.popitem(last=False)
            key = (len(gone.messages), _reply_key(gone.reply))
            self._by_reply[key].remove(n)
            if not self._by_reply[key]:
                del self._by_reply[key]


@dataclass
class Turn:
    """A request rendered in its episode, ready to generate: one sample per choice (the first
    continues an earlier completion's sample when the request continues it), the ids forced at the
    start of each answer (tool_choice), the tools the answer may call."""

    samples: list[Sample]
    forced: list[int]
    tools: list[dict[str, Any]] | None


class ChatEndpoint:
    """The OpenAI-compatible endpoint: ``client`` generates (an SGLangClient, or anything with its
    ``agenerate``; an episode may bring its own), ``tokenizer`` renders and decodes, ``model`` is the
    name ``/v1/models`` gives."""

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        model: str = "policy",
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        default_temperature: float = 1.0,
        tool_parser: str = "hermes",
        api_key: str = "",
    ) -> None:
        """``default_*``: what a request that does not say gets (OpenAI's temperature is 1);
        ``tool_parser``: how tool calls are read from the output (nodes/rollout/chat.py);
        ``api_key``: when set, every request must carry ``Authorization: Bearer <api_key>`` (else 401),
        as the session API of online mode needs (nodes/rollout/sessions.py)."""
        self.api_key = api_key
        self.mounts: dict[str, Callable[[Request], Awaitable[Response | None]]] = {}
        self.client, self.tokenizer, self.model = client, tokenizer, model
        self.parse_tool_calls = chat.tool_parser(tool_parser)
        # Hermes output is content until "<tool_call>": it streams as generated (a custom parser's waits)
        self.streams_tool_text = self.parse_tool_calls is chat.parse_tool_calls
        self.defaults = {"max_new_tokens": default_max_tokens, "temperature": default_temperature}
        self.episodes: dict[str, Episode] = {}
        self.default = Episode("default", keep_samples=False)  # the standalone server's /v1
        self._first_prompts: OrderedDict[bytes, np.ndarray] = OrderedDict()  # FIRST_PROMPTS_KEPT
        self._ids = itertools.count()  # completion ids: this endpoint's random prefix, then a count
        self._id_prefix = uuid.uuid4().hex[:16]
        self.url = ""
        self._server = HTTPServer(self._handle, lambda status, msg: EndpointError(status, msg).response())

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port); returns the root URL."""
        self.url = f"http://{host}:{await self._server.start(host, port)}"
        return self.url

    async def aclose(self) -> None:
        await self._server.aclose()

    def mount(self, prefix: str, handler: Callable[[Request], Awaitable[Response | None]]) -> None:
        """Serve the paths under ``prefix`` with ``handler`` (behind the same key), e.g. the session
        API's ``/rl/v1/``."""
        self.mounts[prefix] = handler

    def open_episode(self, episode_id: str | None = None, client: Any = None) -> tuple[Episode, str]:
        """A new episode and its base_url (give it to ``openai.AsyncOpenAI(base_url=...)``); its
        completions generate through ``client`` (default: the endpoint's)."""
        ep = Episode(episode_id or uuid.uuid4().hex, client=client)
        self.episodes[ep.id] = ep
        return ep, f"{self.url}/episodes/{ep.id}/v1"

    def close_episode(self, episode_id: str) -> Episode:
        """Stop serving an episode; its samples are the caller's."""
        return self.episodes.pop(episode_id)

    # -- routes ------------------------------------------------------------------------------

    async def _handle(self, request: Request) -> Response | None:
        """Route ``request``: ``[/episodes/<id>]/v1/chat/completions`` and ``.../v1/responses``
        (POST, nodes/rollout/responses.py), ``.../v1/models`` (GET). Every failure is OpenAI's error body; none stops the endpoint."""
        try:
            if self.api_key and not _bearer_is(request.headers.get("authorization"), self.api_key):
                raise EndpointError(401, "a missing or wrong API key: send Authorization: Bearer <the run's key>",
                                    code="invalid_api_key")  # fmt: skip
            for prefix, handler in self.mounts.items():
                if request.path.startswith(prefix):
                    return await handler(request)
            ep: Episode | None = self.default
            route = request.path
            if route.startswith("/episodes/"):
                eid, _, rest = route[len("/episodes/") :].partition("/")
                ep, route = self.episodes.get(eid), "/" + rest
                if ep is None and route in ROUTES:
                    raise EndpointError(404, f"no episode {eid!r} is open here", code="episode_not_found")
            allowed = ROUTES.get(route)
            if allowed is None:
                raise EndpointError(404, f"{request.method} {request.path}: Not Found")
            if request.method != allowed:
                raise EndpointError(405, f"{request.method} {request.path}: Method Not Allowed")
            if route == "/v1/models":
                return _json({
                    "object": "list",
                    "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "rlactors"}],
                })  # fmt: skip
            assert ep is not None
            if ep is self.default and self.client is None:  # e.g. online mode's: sessions only
                raise EndpointError(404, "this endpoint serves episodes only: use an episode's (a session's) base_url",
                                    code="episode_not_found")  # fmt: skip
            ep.inflight += 1
            try:
                if route == "/v1/responses":
                    return await self._responses(request, ep)
                return await self._chat(request, ep)
            finally:
                ep.inflight -= 1
        except EndpointError as e:
            return e.response()
        except Exception as e:
            log.exception("openai_endpoint.error", path=request.path)
            return EndpointError(500, f"internal error: {type(e).__name__}: {e}").response()

    async def _chat(self, request: Request, ep: Episode) -> Response | None:
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError as e:
            raise EndpointError(400, f"the request body is not valid JSON: {e}") from None
        req = ChatRequest.parse(body, self.defaults)
        ep.counters["calls"] += 1
        turn = await self.begin_turn(ep, req)
        head = {"id": f"chatcmpl-{self._id_prefix}{next(self._ids):x}", "created": int(time.time()), "model": self.model,
                "system_fingerprint": None}  # fmt: skip
        if req.stream:
            return await stream_chat(
                self, request, ep, req, turn, {**head, "object": "chat.completion.chunk"}
            )
        try:
            choices = await self.generate_turn(ep, req, turn)
        except GenerationError as e:
            ep.counters["errors"] += 1
            raise EndpointError(503, f"generation failed: {e}") from None
        return _json({
            **head, "object": "chat.completion",
            "choices": [
                {"index": i, "message": msg, "logprobs": self._logprobs(res, req) if req.logprobs else None,
                 "finish_reason": finish}
                for i, (msg, res, finish) in enumerate(choices)
            ],
            "usage": self.usage(choices),
        })  # fmt: skip

    async def _responses(self, request: Request, ep: Episode) -> Response | None:
        """``/v1/responses``: the request read as the chat turn it means (nodes/rollout/responses.py),
        generated as chat turns are, answered as output items or the SDK's stream events."""
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError as e:
            raise EndpointError(400, f"the request body is not valid JSON: {e}") from None
        try:
            req = ResponsesRequest.from_json(body)
            history: list[dict[str, Any]] = []
            if req.previous_response_id is not None:
                kept = ep.responses.get(req.previous_response_id)
                if kept is None:
                    raise EndpointError(400, f"previous_response_id {req.previous_response_id!r}: no stored "
                                        "response of this episode", "previous_response_id",
                                        "previous_response_not_found")  # fmt: skip
                history = kept
            messages, conversation, sampling = chat_args(req, history, self.defaults)
        except OpenAIError as e:
            raise EndpointError(400, str(e), e.param) from None
        creq = ChatRequest(messages, req.chat_tools(), req.chat_tool_choice(), 1, req.stream, False, False, 0,
                           sampling)  # fmt: skip
        ep.counters["calls"] += 1
        turn = await self.begin_turn(ep, creq)
        shape = ResponseShape(req, new_id("resp"), self.model)
        if req.stream:
            return await stream_responses(self, request, ep, creq, turn, shape, conversation)
        try:
            ((msg, res, finish),) = await self.generate_turn(ep, creq, turn)
        except GenerationError as e:
            ep.counters["errors"] += 1
            raise EndpointError(503, f"generation failed: {e}") from None
        if req.store:
            ep.keep_response(shape.id, [*conversation, msg])
        return Response(200, orjson.dumps(shape.response(output_items(msg), res, finish)))

    @staticmethod
    def usage(choices: list[tuple[dict[str, Any], GenResult, str]]) -> dict[str, int]:
        """OpenAI's ``usage`` of a request's choices."""
        prompt, completion = choices[0][1].prompt_tokens, sum(len(r.output_ids) for _, r, _ in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- generation ----------------------------------------------------------------------------

    async def complete(self, ep: Episode, req: ChatRequest) -> list[tuple[dict[str, Any], GenResult, str]]:
        """Generate ``req.n`` choices in ``ep``: ``(assistant message, result, finish_reason)`` each."""
        return await self.generate_turn(ep, req, await self.begin_turn(ep, req))

    async def begin_turn(self, ep: Episode, req: ChatRequest) -> Turn:
        """Render ``req`` in ``ep``: continue the completion it extends, else start a sample
        (:class:`EndpointError` 400 when the template cannot render it)."""
        tools = req.tools if req.tool_choice != "none" else None
        found = ep.find(req.messages, tools, req.sampling["temperature"])
        if found is not None:
            ep.counters["continued"] += 1
            done, start = found
            new = await _render(
                _chars(req.messages[start:]), continuation_ids, self.tokenizer, done.messages, req.messages[start:], tools,
                done.last_id, done.finish_reason,
            )  # fmt: skip
            base = done.sample
            base.add_context(new)
        else:
            ep.counters["new_samples"] += 1
            base = ep.add_sample(
                Sample(await self._prompt_ids(req.messages, tools), req.sampling["temperature"])
            )
        forced = self._forced_prefix(req)
        samples = [base] + [ep.add_sample(base.fork()) for _ in range(req.n - 1)]
        if forced:
            for s in samples:
                s.add_context(forced)
        return Turn(samples, forced, tools)

    async def _prompt_ids(self, messages: list[dict[str, Any]], tools: Any) -> np.ndarray:
        """The prompt's ids (read-only: a :class:`Sample` copies them), from
        :data:`FIRST_PROMPTS_KEPT` when these messages and tools were rendered before."""
        key = orjson.dumps([messages, tools])
        kept = self._first_prompts.get(key)
        if kept is not None:
            self._first_prompts.move_to_end(key)
            return kept
        try:
            size = _chars(messages) + (len(orjson.dumps(tools)) if tools else 0)
            ids = np.array(await _render(size, prompt_ids, self.tokenizer, messages, tools), IDS_DTYPE)
        except ChatError as e:
            raise EndpointError(400, str(e), "messages") from None
        ids.flags.writeable = False
        self._first_prompts[key] = ids
        if len(self._first_prompts) > FIRST_PROMPTS_KEPT:
            self._first_prompts.popitem(last=False)
        return ids

    async def generate_turn(
        self, ep: Episode, req: ChatRequest, turn: Turn, on_tokens: list[TokensCallback] | None = None
    ) -> list[tuple[dict[str, Any], GenResult, str]]:
        """Generate each choice of ``turn`` (``on_tokens[i]`` gets choice i's tokens as they arrive)
        and read the answers: ``(assistant message, result, finish_reason)`` each."""
        feeds = on_tokens or [None] * len(turn.samples)
        if len(turn.samples) == 1:  # no tasks for one choice
            results = [await self._generate(ep, turn.samples[0], req, feeds[0])]
        else:
            results = await asyncio.gather(
                *(self._generate(ep, s, req, f) for s, f in zip(turn.samples, feeds, strict=True))
            )
        out = []
        for s, res in zip(turn.samples, results, strict=True):
            s.add_output(res)
            out_ids = [*turn.forced, *res.output_ids] if turn.forced else res.output_ids
            text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
            text = _trim_stop(text, res, req)
            msg, finish = self._message(text, res, req, turn.tools)
            ep.counters["tool_calls"] += len(msg.get("tool_calls") or ())
            last = res.output_ids[-1:] or turn.forced[-1:]
            ep.keep(_Completion(req.messages, turn.tools, msg, s, len(s.ids), last, res.finish_reason))
            out.append((msg, res, finish))
        return out

    async def _generate(
        self, ep: Episode, s: Sample, req: ChatRequest, on_tokens: TokensCallback | None
    ) -> GenResult:
        rid = s.meta["rid"]
        trace_id = s.meta.setdefault("trace_id", rid.rstrip("/"))
        # the prompt goes out as a list, as the built-in workflows' do (the trajectory keeps the array)
        request = GenRequest(s.ids.tolist(), dict(req.sampling), rid, req.top_logprobs, trace_id, on_tokens)
        return await (ep.client or self.client).agenerate(request)

    def _forced_prefix(self, req: ChatRequest) -> list[int]:
        """Ids put at the start of the answer for tool_choice ``required`` or a named function
        (no grammar here: the call's opening is written for the model; context, not trained on)."""
        if req.tool_choice == "required":
            return list(self.tokenizer.encode("<tool_call>\n", add_special_tokens=False))
        if isinstance(req.tool_choice, dict):
            name = req.tool_choice["function"]["name"]
            head = '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '
            return list(self.tokenizer.encode(head, add_special_tokens=False))
        return []

    def _message(self, text: str, res: GenResult, req: ChatRequest, tools: Any) -> tuple[dict[str, Any], str]:
        finish = "length" if res.finish_reason == "length" else "stop"
        calls: list[ToolCall] = []
        content: str | None = text
        if tools:
            content, calls = self.parse_tool_calls(text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [c.as_openai() for c in calls]
            finish = "tool_calls" if finish == "stop" else finish
        return msg, finish

    def logprob_entry(self, tid: int, lp: float, tops: list[tuple[float, int]], top_n: int) -> dict[str, Any]:
        """OpenAI's log-prob entry of one output token, with its ``top_n`` most likely tokens."""
        e = self._token_entry(tid, lp)
        e["top_logprobs"] = [self._token_entry(t, v) for v, t in tops[:top_n]]
        return e

    def _token_entry(self, tid: int, lp: float) -> dict[str, Any]:
        text = self.tokenizer.decode([tid])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    def _logprobs(self, res: GenResult, req: ChatRequest) -> dict[str, Any]:
        tops = res.output_top_logprobs
        content = [
            self.logprob_entry(tid, lp, tops[i] if i < len(tops) else [], req.top_logprobs)
            for i, (tid, lp) in enumerate(zip(res.output_ids, res.output_logprobs, strict=True))
        ]
        return {"content": content, "refusal": None}


def _chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) for m in messages)


async def _render(chars: int, fn: Callable[..., list[int]], *args: Any) -> list[int]:
    """``fn(*args)`` (rendering and tokenising ``chars`` characters), on the loop when that is
    short (:data:`INLINE_RENDER_CHARS`), else in a thread."""
    if chars <= INLINE_RENDER_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _trim_stop(text: str, res: GenResult, req: ChatRequest) -> str:
    """OpenAI leaves a matched stop string out of the content."""
    if res.finish_reason == "stop" and isinstance(res.matched_stop, str) and text.endswith(res.matched_stop):
        return text[: -len(res.matched_stop)]
    return text


def _bearer_is(header: str | None, key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time (as SGLang's servers compare theirs)."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())


def _json(obj: Any, status: int = 200) -> Response:
    return Response(status, orjson.dumps(obj))


# -- streamed answers ----------------------------------------------------------------------------
#
# Streamed chat completions (``"stream": true``): OpenAI's server-sent chunks, sent as the model
# generates.
#
# The endpoint asks the client for the tokens as they arrive (``GenRequest.on_tokens``; the rollout
# client then streams each post, across aborts, resumes and failovers), decodes them incrementally
# and sends each token's text as a content delta, with its log-probs when asked. Text that may yet
# turn out to be something else is held back until it is known: a ``<tool_call>`` opening (from
# there on the output is tool calls, sent as OpenAI's ``tool_calls`` deltas once the answer is read)
# and the start of a stop string (OpenAI leaves a matched stop string out). A client that cannot
# stream (anything with only ``agenerate``) gets the same chunks once its answer is complete.
#
# With several choices (``n``), their chunks interleave, each with its ``index``, as OpenAI's do.
# A generation that fails after the first chunk ends the stream with an error event (the SDK raises
# ``openai.APIError``); a client that goes away stops the writing, not the generation (its episode
# still gets the tokens).

TOOL_OPEN = "<tool_call>"


class SSEWriter:
    """One response's chunks, written whole and in order whichever choice sends them."""

    def __init__(self, resp: Stream, head: dict[str, Any]) -> None:
        self.resp, self.head = resp, head
        self.gone = False  # the client went away: nothing more is written
        self._lock = asyncio.Lock()

    async def chunk(self, choice: dict[str, Any] | None, **extra: Any) -> None:
        await self.raw(orjson.dumps({**self.head, "choices": [] if choice is None else [choice], **extra}))

    async def raw(self, data: bytes) -> None:
        if self.gone:
            return
        async with self._lock:
            try:
                await self.resp.write(b"data: " + data + b"\n\n")
            except ConnectionError:  # the client went away
                self.gone = True


class _Choice:
    """One choice's content, streamed as its tokens arrive."""

    def __init__(self, index: int, endpoint: ChatEndpoint, req: ChatRequest, forced: list[int], tools: Any,
                 out: SSEWriter) -> None:  # fmt: skip
        self.index, self.endpoint, self.req, self.out = index, endpoint, req, out
        self.tok = endpoint.tokenizer
        self.ids = list(forced)  # decoded together: a forced tool-call opening holds everything back
        self.n_forced = len(forced)
        self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        self._window = (0, len(self.ids))  # incremental decoding: prefix, read offsets in ids
        self.sent = 0  # characters of text sent as content
        self.pending: list[dict[str, Any]] = []  # log-prob entries of tokens whose text is held
        # text that may not be content yet: a tool call's opening, a stop string's start
        self.holds = ([TOOL_OPEN] if tools else []) + list(req.sampling.get("stop") or ())
        # a custom tool parser may read anything as a call: then content waits for the whole answer
        self.live = not tools or endpoint.streams_tool_text
        self.tools = bool(tools)
        self.queue: asyncio.Queue[tuple[list[int], list[float], list[Any]] | None] = asyncio.Queue()
        self.task = asyncio.ensure_future(self._pump())

    def feed(self, ids: list[int], lps: list[float], tops: list[Any]) -> None:
        """The client's callback (``GenRequest.on_tokens``): new tokens of this choice."""
        self.queue.put_nowait((ids, lps, tops))

    async def _pump(self) -> None:
        while (item := await self.queue.get()) is not None:
            for k, tid in enumerate(item[0]):
                await self._token(
                    tid, item[1][k] if k < len(item[1]) else 0.0, item[2][k] if k < len(item[2]) else []
                )

    async def _token(self, tid: int, lp: float, tops: list[tuple[float, int]]) -> None:
        self.ids.append(tid)
        prefix, read = self._window
        before = self.tok.decode(self.ids[prefix:read], skip_special_tokens=True)
        now = self.tok.decode(self.ids[prefix:], skip_special_tokens=True)
        if not now.endswith("\ufffd"):  # a character cut in the middle waits for its next bytes
            self.text += now[len(before) :]
            self._window = (read, len(self.ids))
        if self.req.logprobs:
            self.pending.append(self.endpoint.logprob_entry(tid, lp, tops, self.req.top_logprobs))
        if self.live:
            end = self._safe_end()
            if end > self.sent:
                await self._send(self.text[self.sent : end])

    def _safe_end(self) -> int:
        """How much of the text is surely content: up to a tool call's opening, and short of any
        end that may be the start of a hold (or, with tools, whitespace before a call)."""
        t = self.text
        if self.tools and (start := t.find(TOOL_OPEN)) >= 0:
            return max(self.sent, len(t[:start].rstrip()))
        end = len(t)
        for h in self.holds:
            for k in range(min(len(h), len(t)), 0, -1):
                if t.endswith(h[:k]):
                    end = min(end, len(t) - k)
                    break
        if self.tools:
            end = len(t[:end].rstrip())
        return max(self.sent, end)

    async def _send(self, piece: str) -> None:
        lp = {"content": self.pending, "refusal": None} if self.req.logprobs else None
        self.pending = []
        self.sent += len(piece)
        await self.out.chunk(
            {"index": self.index, "delta": {"content": piece}, "logprobs": lp, "finish_reason": None}
        )

    async def finish(self, msg: dict[str, Any], res: GenResult, finish: str) -> None:
        """The answer is read: what is left of its content, its tool calls, its finish reason."""
        self.queue.put_nowait(None)
        await self.task
        got = len(self.ids) - self.n_forced
        if res.output_ids[:got] != self.ids[self.n_forced :]:
            log.warning(
                "openai_endpoint.stream_mismatch", index=self.index, streamed=got, output=len(res.output_ids)
            )
        else:  # what did not stream (all of it, from a client that cannot): token by token now
            tops = res.output_top_logprobs
            for k in range(got, len(res.output_ids)):
                await self._token(res.output_ids[k], res.output_logprobs[k], tops[k] if k < len(tops) else [])
        content = msg.get("content") or ""
        streamed = self.text[: self.sent]
        if content.startswith(streamed):
            if len(content) > len(streamed) or self.pending:
                await self._send(content[len(streamed) :])
        else:  # the parser's content differs from what streamed (whitespace around a tool call)
            log.debug("openai_endpoint.stream_content_differs", index=self.index)
        for j, call in enumerate(msg.get("tool_calls") or ()):
            fn = call["function"]
            first = {
                "index": j,
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": ""},
            }
            await self.out.chunk({"index": self.index, "delta": {"tool_calls": [first]}, "logprobs": None,
                                  "finish_reason": None})  # fmt: skip
            more = {"index": j, "function": {"arguments": fn["arguments"]}}
            await self.out.chunk({"index": self.index, "delta": {"tool_calls": [more]}, "logprobs": None,
                                  "finish_reason": None})  # fmt: skip
        await self.out.chunk({"index": self.index, "delta": {}, "logprobs": None, "finish_reason": finish})


async def stream_chat(
    endpoint: ChatEndpoint,
    request: Request,
    ep: Episode,
    req: ChatRequest,
    turn: Turn,
    head: dict[str, Any],
) -> None:
    """Answer ``req`` (rendered as ``turn``) as server-sent chunks while it generates."""
    resp = await request.stream(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    out = SSEWriter(resp, head)
    choices = [_Choice(i, endpoint, req, turn.forced, turn.tools, out) for i in range(req.n)]
    for c in choices:
        await out.chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})  # fmt: skip
    try:
        answers = await endpoint.generate_turn(ep, req, turn, [c.feed for c in choices])
        for c, (msg, res, finish) in zip(choices, answers, strict=True):
            await c.finish(msg, res, finish)
        if req.include_usage:
            await out.chunk(None, usage=endpoint.usage(answers))
    except GenerationError as e:
        ep.counters["errors"] += 1
        err = {"message": f"generation failed: {e}", "type": "server_error", "param": None, "code": None}
        await out.raw(orjson.dumps({"error": err}))
    finally:  # a failure leaves pumps waiting for tokens that will not come
        for c in choices:
            c.task.cancel()
        await asyncio.gather(*(c.task for c in choices), return_exceptions=True)
    await out.raw(b"[DONE]")
    with contextlib.suppress(ConnectionError):
        await resp.end()


async def stream_responses(
    endpoint: ChatEndpoint,
    request: Request,
    ep: Episode,
    creq: ChatRequest,
    turn: Turn,
    shape: ResponseShape,
    conversation: list[dict[str, Any]],
) -> None:
    """Answer a ``/v1/responses`` request as the SDK's events while the model generates: the chat
    choice's chunks (:class:`_Choice`) translated by :class:`ResponseEvents`."""
    resp = await request.stream(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    out = ResponseEvents(resp)
    await out.event("response.created", response=shape.response([], None, None, "in_progress"))
    await out.event("response.in_progress", response=shape.response([], None, None, "in_progress"))
    choice = _Choice(0, endpoint, creq, turn.forced, turn.tools, out)  # type: ignore[arg-type]
    try:
        ((msg, res, finish),) = await endpoint.generate_turn(ep, creq, turn, [choice.feed])
        out.msg = msg
        await choice.finish(msg, res, finish)
        # the final items are the answer as read (ids as streamed): what a reply must send back
        items = output_items(msg, [i["id"] for i in out.items])
        if shape.req.store:
            ep.keep_response(shape.id, [*conversation, msg])
        final = shape.response(items, res, finish)
        await out.event(f"response.{final['status']}", response=final)
    except GenerationError as e:
        ep.counters["errors"] += 1
        message = f"generation failed: {e}"
        await out.event("error", code="server_error", message=message, param=None)
        failed = shape.response(out.items, None, None, "failed")
        failed["error"] = {"code": "server_error", "message": message}
        await out.event("response.failed", response=failed)
    finally:  # a failure leaves the pump waiting for tokens that will not come
        choice.task.cancel()
        await asyncio.gather(choice.task, return_exceptions=True)
    with contextlib.suppress(ConnectionError):
        await resp.end()


@dataclass
class EndpointArgs:
    """The command line of ``python -m nodes.rollout.openai_endpoint``: the endpoint alone, in front
    of SGLang-protocol servers, to try an agent without training."""

    server_url: list[str] = field(default_factory=list)  # an SGLang or reference server (at least one)
    model_path: str = ""  # the served model's folder (its tokenizer and chat template); required
    model_name: str = ""  # the name /v1/models gives ("": the model folder's name)
    tool_parser: str = "hermes"  # how tool calls are read from the output: hermes (= qwen25) or module:fn
    host: str = "127.0.0.1"  # the address to listen on
    port: int = 8000  # the port to listen on (0: a free one)
    # the servers' --api-key ("": $RLACTORS_SERVER_API_KEY, else none)
    api_key: str = field(default="", repr=False)
    # the servers' --admin-api-key ("": $RLACTORS_SERVER_ADMIN_API_KEY, else none)
    admin_api_key: str = field(default="", repr=False)


def parse_args(argv: list[str] | None = None) -> EndpointArgs:
    """:class:`EndpointArgs` from the command line (flags, ``--help`` and defaults made from it)."""
    from nodes.inference.settings import add_flags, from_namespace

    ap = argparse.ArgumentParser(
        prog="python -m nodes.rollout.openai_endpoint", description=EndpointArgs.__doc__
    )
    add_flags(ap, EndpointArgs)
    args: EndpointArgs = from_namespace(ap.parse_args(argv), EndpointArgs)
    if not args.server_url or not args.model_path:
        ap.error("--server-url (one or more) and --model-path are required")
    args.api_key = args.api_key or os.environ.get("RLACTORS_SERVER_API_KEY", "")
    args.admin_api_key = args.admin_api_key or os.environ.get("RLACTORS_SERVER_ADMIN_API_KEY", "")
    return args


def main(argv: list[str] | None = None) -> None:
    """Serve the endpoint in front of SGLang-protocol servers (:class:`EndpointArgs`)."""
    args = parse_args(argv)

    async def serve() -> None:
        from pathlib import Path

        from transformers import AutoTokenizer

        from nodes.rollout.client import ClientConfig, SGLangClient

        tokenizer = AutoTokenizer.from_pretrained(args.model_path, local_files_only=True)
        keys = ServerKeys(args.api_key, args.admin_api_key)
        client = SGLangClient(args.server_url, ClientConfig(keys=keys))
        name = args.model_name or Path(args.model_path).name
        endpoint = ChatEndpoint(client, tokenizer, name, tool_parser=args.tool_parser)
        url = await endpoint.start(args.host, args.port)
        print(f"base_url: {url}/v1", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await endpoint.aclose()
            await client.aclose()

    run: Any = asyncio.run
    try:
        import uvloop

        run = uvloop.run  # the loop a rollout actor (and so its endpoint) runs on
    except ImportError:
        pass
    try:
        run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
