"""``/v1/chat/completions`` on the OpenAI-compatible endpoint (nodes/rollout/openai_endpoint.py):
the request checked (:class:`~nodes.rollout.turns.ChatRequest`), rendered and generated in its
episode, token-exact (nodes/rollout/turns.py), and answered as OpenAI does, whole or streamed.

Streamed (``"stream": true``): OpenAI's server-sent chunks, sent as the model generates. The
endpoint asks the client for the tokens as they arrive (``GenRequest.on_tokens``; the rollout
client then streams each post, across aborts, resumes and failovers), decodes them incrementally
and sends each token's text as a content delta, with its log-probs when asked. Text that may yet
turn out to be something else is held back until it is known: a ``<tool_call>`` opening (from
there on the output is tool calls, sent as OpenAI's ``tool_calls`` deltas once the answer is read)
and the start of a stop string (OpenAI leaves a matched stop string out). A client that cannot
stream (anything with only ``agenerate``) gets the same chunks once its answer is complete.

With several choices (``n``), their chunks interleave, each with its ``index``, as OpenAI's do.
A generation that fails after the first chunk ends the stream with an error event (the SDK raises
``openai.APIError``); a client that goes away stops the writing, not the generation (its episode
still gets the tokens). :class:`StreamedChoice` is also what ``/v1/responses`` streams through
(nodes/rollout/responses.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson
import structlog

from nodes.rollout.client import GenerationError, GenResult
from nodes.rollout.http1 import Request, Response, Stream
from nodes.rollout.openai_http import EndpointError, json_response, new_id, read_json
from nodes.rollout.turns import ChatRequest, Episode, Turn, Turns

__all__ = ["SSEWriter", "StreamedChoice", "answer_chat", "logprob_entry", "stream_chat", "usage"]

log = structlog.get_logger(__name__)

Choice = tuple[dict[str, Any], GenResult, str]  # (assistant message, result, finish_reason)


async def answer_chat(
    turns: Turns, request: Request, ep: Episode, client: Any, model: str
) -> Response | None:
    """Answer a ``/v1/chat/completions`` request in ``ep``, generating through ``client``."""
    req = ChatRequest.parse(read_json(request), turns.defaults)
    ep.counters["calls"] += 1
    turn = await turns.begin(ep, req)
    head = {
        "id": new_id("chatcmpl", "-"),
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }
    if req.stream:
        await stream_chat(turns, request, ep, req, turn, client, {**head, "object": "chat.completion.chunk"})
        return None  # answered as it streamed
    try:
        choices = await turns.generate(ep, req, turn, client)
    except GenerationError as e:
        ep.counters["errors"] += 1
        raise EndpointError(503, f"generation failed: {e}") from None
    tok = turns.tokenizer
    return json_response(
        {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": i,
                    "message": msg,
                    "logprobs": _logprobs(tok, res, req) if req.logprobs else None,
                    "finish_reason": finish,
                }
                for i, (msg, res, finish) in enumerate(choices)
            ],
            "usage": usage(choices),
        }
    )


def usage(choices: list[Choice]) -> dict[str, int]:
    """OpenAI's ``usage`` of a request's choices."""
    prompt, completion = choices[0][1].prompt_tokens, sum(len(r.output_ids) for _, r, _ in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def logprob_entry(
    tokenizer: Any, tid: int, lp: float, tops: list[tuple[float, int]], top_n: int
) -> dict[str, Any]:
    """OpenAI's log-prob entry of one output token, with its ``top_n`` most likely tokens."""
    e = _token_entry(tokenizer, tid, lp)
    e["top_logprobs"] = [_token_entry(tokenizer, t, v) for v, t in tops[:top_n]]
    return e


def _token_entry(tokenizer: Any, tid: int, lp: float) -> dict[str, Any]:
    text = tokenizer.decode([tid])
    return {"token": text, "logprob": lp, "bytes": list(text.encode())}


def _logprobs(tokenizer: Any, res: GenResult, req: ChatRequest) -> dict[str, Any]:
    tops = res.output_top_logprobs
    content = [
        logprob_entry(tokenizer, tid, lp, tops[i] if i < len(tops) else [], req.top_logprobs)
        for i, (tid, lp) in enumerate(zip(res.output_ids, res.output_logprobs, strict=True))
    ]
    return {"content": content, "refusal": None}


# -- streamed answers ----------------------------------------------------------------------------

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


class StreamedChoice:
    """One choice's content, streamed as its tokens arrive."""

    def __init__(
        self, index: int, turns: Turns, req: ChatRequest, forced: list[int], tools: Any, out: SSEWriter
    ) -> None:
        """``out``: an :class:`SSEWriter`, or anything with its ``chunk`` (responses' events)."""
        self.index, self.req, self.out = index, req, out
        self.tok = turns.tokenizer
        self.ids = list(forced)  # decoded together: a forced tool-call opening holds everything back
        self.n_forced = len(forced)
        self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        self._window = (0, len(self.ids))  # incremental decoding: prefix, read offsets in ids
        self.sent = 0  # characters of text sent as content
        self.pending: list[dict[str, Any]] = []  # log-prob entries of tokens whose text is held
        # text that may not be content yet: a tool call's opening, a stop string's start
        self.holds = ([TOOL_OPEN] if tools else []) + list(req.sampling.get("stop") or ())
        # a custom tool parser may read anything as a call: then content waits for the whole answer
        self.live = not tools or turns.streams_tool_text
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
            self.pending.append(logprob_entry(self.tok, tid, lp, tops, self.req.top_logprobs))
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
            await self.out.chunk(
                {
                    "index": self.index,
                    "delta": {"tool_calls": [first]},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
            more = {"index": j, "function": {"arguments": fn["arguments"]}}
            await self.out.chunk(
                {
                    "index": self.index,
                    "delta": {"tool_calls": [more]},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        await self.out.chunk({"index": self.index, "delta": {}, "logprobs": None, "finish_reason": finish})


async def stream_chat(
    turns: Turns,
    request: Request,
    ep: Episode,
    req: ChatRequest,
    turn: Turn,
    client: Any,
    head: dict[str, Any],
) -> None:
    """Answer ``req`` (rendered as ``turn``) as server-sent chunks while ``client`` generates it."""
    resp = await request.stream(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    out = SSEWriter(resp, head)
    choices = [StreamedChoice(i, turns, req, turn.forced, turn.tools, out) for i in range(req.n)]
    for c in choices:
        await out.chunk(
            {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )
    try:
        answers = await turns.generate(ep, req, turn, client, [c.feed for c in choices])
        for c, (msg, res, finish) in zip(choices, answers, strict=True):
            await c.finish(msg, res, finish)
        if req.include_usage:
            await out.chunk(None, usage=usage(answers))
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
