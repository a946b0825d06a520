"""An episode's conversation, token-exact: the turn machinery of the OpenAI-compatible endpoint
(nodes/rollout/openai_endpoint.py), which its chat completions (nodes/rollout/chat_completions.py)
and responses (nodes/rollout/responses.py) both generate through.

An :class:`Episode` keeps every completion it served. A request that continues one (its messages
are that completion's messages, the assistant answer it got, then new messages) extends that
completion's exact token ids with the template's rendering of only the new messages: the model's
output is never re-tokenised, and an episode is one token sequence (a :class:`Sample`: numpy arrays
of the trajectory's dtypes, grown by concatenation) whose loss mask covers exactly the model's
tokens. A request that does not continue one (the agent edited its history) starts another sample;
``Episode.counters`` says how often that happened. :class:`Turns` renders a request in its episode
(:meth:`Turns.begin`), generates its choices through a client that aborts, resumes and fails over
as for any episode (:meth:`Turns.generate`) and reads the answers (tool calls included).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from nodes.rollout import chat
from nodes.rollout.chat import ChatError, ToolCall, continuation_ids, prompt_ids
from nodes.rollout.chunks import TokensCallback
from nodes.rollout.client import GenRequest, GenResult
from nodes.rollout.openai_http import EndpointError
from nodes.rollout.workflows import Sample
from protocols.http.openai import ChatCompletionRequest, OpenAIError
from protocols.rl import IDS_DTYPE, Trajectory

__all__ = ["ChatRequest", "Episode", "Turn", "Turns"]

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
        """Check ``body`` (:class:`protocols.http.openai.ChatCompletionRequest`; 400 naming the field);
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
        return cls(
            [m.normalized() for m in req.messages],
            req.tools,
            req.tool_choice,
            req.n,
            bool(req.stream),
            bool(options.get("include_usage")),
            bool(req.logprobs),
            req.top_logprobs,
            sampling,
        )


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
    # call id -> the arguments text a call was served with, where an API that sends a call back as
    # an object (Anthropic's tool_use input: nodes/rollout/messages.py) would not give that text
    tool_arguments: OrderedDict[str, str] = field(default_factory=OrderedDict)

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

    def keep_tool_arguments(self, call_id: str, arguments: str) -> None:
        """Keep the arguments text a tool call was served with (see ``tool_arguments``)."""
        self.tool_arguments[call_id] = arguments
        while len(self.tool_arguments) > KEPT_COMPLETIONS:
            self.tool_arguments.popitem(last=False)

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


class Turns:
    """Renders, generates and reads an episode's turns: ``tokenizer`` renders and decodes,
    ``tool_parser`` reads tool calls from the output (nodes/rollout/chat.py), ``defaults`` gives a
    request's max_new_tokens and temperature where it does not say."""

    def __init__(self, tokenizer: Any, tool_parser: str, defaults: dict[str, Any]) -> None:
        self.tokenizer, self.defaults = tokenizer, defaults
        self.parse_tool_calls = chat.tool_parser(tool_parser)
        # Hermes output is content until "<tool_call>": it streams as generated (a custom parser's waits)
        self.streams_tool_text = self.parse_tool_calls is chat.parse_tool_calls
        self._first_prompts: OrderedDict[bytes, np.ndarray] = OrderedDict()  # FIRST_PROMPTS_KEPT

    async def complete(
        self, ep: Episode, req: ChatRequest, client: Any
    ) -> list[tuple[dict[str, Any], GenResult, str]]:
        """Generate ``req.n`` choices in ``ep`` through ``client``: ``(assistant message, result,
        finish_reason)`` each."""
        return await self.generate(ep, req, await self.begin(ep, req), client)

    async def begin(self, ep: Episode, req: ChatRequest) -> Turn:
        """Render ``req`` in ``ep``: continue the completion it extends, else start a sample
        (:class:`EndpointError` 400 when the template cannot render it)."""
        tools = req.tools if req.tool_choice != "none" else None
        found = ep.find(req.messages, tools, req.sampling["temperature"])
        if found is not None:
            ep.counters["continued"] += 1
            done, start = found
            new = await _render(
                _chars(req.messages[start:]),
                continuation_ids,
                self.tokenizer,
                done.messages,
                req.messages[start:],
                tools,
                done.last_id,
                done.finish_reason,
            )
            base = done.sample
            base.add_context(new)
        else:
            ep.counters["new_samples"] += 1
            base = ep.add_sample(
                Sample(await self.prompt_ids(req.messages, tools), req.sampling["temperature"])
            )
        forced = self._forced_prefix(req)
        samples = [base] + [ep.add_sample(base.fork()) for _ in range(req.n - 1)]
        if forced:
            for s in samples:
                s.add_context(forced)
        return Turn(samples, forced, tools)

    async def prompt_ids(self, messages: list[dict[str, Any]], tools: Any) -> np.ndarray:
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

    async def generate(
        self,
        ep: Episode,
        req: ChatRequest,
        turn: Turn,
        client: Any,
        on_tokens: list[TokensCallback] | None = None,
    ) -> list[tuple[dict[str, Any], GenResult, str]]:
        """Generate each choice of ``turn`` through ``client`` (``on_tokens[i]`` gets choice i's
        tokens as they arrive) and read the answers: ``(assistant message, result, finish_reason)``
        each."""
        feeds: list[TokensCallback | None] = [*on_tokens] if on_tokens else [None] * len(turn.samples)
        if len(turn.samples) == 1:  # no tasks for one choice
            results = [await _generate(client, turn.samples[0], req, feeds[0])]
        else:
            results = await asyncio.gather(
                *(_generate(client, s, req, f) for s, f in zip(turn.samples, feeds, strict=True))
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


async def _generate(client: Any, s: Sample, req: ChatRequest, on_tokens: TokensCallback | None) -> GenResult:
    rid = s.meta["rid"]
    trace_id = s.meta.setdefault("trace_id", rid.rstrip("/"))
    # the prompt goes out as a list, as the built-in workflows' do (the trajectory keeps the array)
    request = GenRequest(s.ids.tolist(), dict(req.sampling), rid, req.top_logprobs, trace_id, on_tokens)
    return await client.agenerate(request)


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
