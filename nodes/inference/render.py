"""How the reference server renders its answers: SGLang's JSON bodies (by orjson, as SGLang), its
error shape for every refused or failed request, and ``/generate``'s server-sent events.

Every error body of the server is made here (:func:`error`, :func:`stream_error`), in SGLang 0.5.x's
shapes: ``{"error": {"message": ...}}`` with the status code, and in a stream an ``error`` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import JSONResponse as _StarletteJSON

from nodes.inference.scheduler import Scheduler
from protocols.http.sglang import GenerateResult, ProtocolError, error_body, success_body

__all__ = [
    "HEAVY_ENTRIES",
    "OrjsonResponse",
    "entries",
    "error",
    "generate_body",
    "ok_or_400",
    "stream_error",
    "stream_events",
    "unauthorized",
]


class OrjsonResponse(_StarletteJSON):
    """JSON rendered by orjson, as SGLang renders its responses (``SGLangORJSONResponse``): much
    cheaper than ``json.dumps`` for a ``/generate`` answer with logprobs (bench/RESULTS.md); a NaN
    or infinite float is ``null``, as there."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


def error(message: str, status: int = 400) -> OrjsonResponse:
    """A refused or failed request, in SGLang's shape: ``{"error": {"message": ...}}``."""
    return OrjsonResponse(error_body(message), status_code=status)


def unauthorized() -> OrjsonResponse:
    """A request without the key its route needs: 401 ``{"error": "Unauthorized"}``, as SGLang 0.5.23."""
    return OrjsonResponse({"error": "Unauthorized"}, status_code=401)


def ok_or_400(ok: bool, message: str, **extra: Any) -> OrjsonResponse:
    """A weight endpoint's answer, ``{"success", "message", ...}``: 200 when it succeeded, else 400."""
    return OrjsonResponse(success_body(ok, message, **extra), status_code=200 if ok else 400)


def stream_error(exc: Exception) -> bytes:
    """The event that ends a stream whose sequence failed: 400 for a refused request, else 500."""
    code = 400 if isinstance(exc, ProtocolError) else 500
    err = {
        "message": str(exc),
        "type": "invalid_request_error" if code == 400 else "server_error",
        "code": code,
        "retryable": False,
    }
    return b"data: " + orjson.dumps({"error": err}) + b"\n\n"


_PER_OUTPUT_TOKEN = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def _delta(event: dict[str, Any], sent: list[int]) -> dict[str, Any]:
    """An event of ``--incremental-streaming-output``: the output ids, text and per-token
    log-prob entries new since this sequence's previous event (``sent``: how many ids and
    characters went out before; updated). The rest of ``meta_info`` is as in a full event."""
    n_ids, n_text = sent
    ids, text = event["output_ids"], event["text"]
    sent[0], sent[1] = len(ids), len(text)
    event["output_ids"], event["text"] = ids[n_ids:], text[n_text:]
    meta = event["meta_info"]
    for key in _PER_OUTPUT_TOKEN:
        if key in meta:
            meta[key] = meta[key][n_ids:]
    return event


# a response with more log-prob entries than this is rendered in a worker thread, not on the event loop
HEAVY_ENTRIES = 20_000


def entries(res: GenerateResult) -> int:
    """How many log-prob entries rendering ``res`` makes (0 without ``return_logprob``)."""
    lp = res.logprobs
    if lp is None:
        return 0
    width = 1 + (len(lp.output_top[0]) if lp.output_top else 0) + len(lp.token_ids or ())
    return (len(lp.output) + len(lp.input)) * width


def generate_body(results: list[GenerateResult], many: bool) -> bytes:
    """The ``/generate`` answer: one body, or a list of them, each rendered on its own (orjson
    holds the GIL for a whole call: one call per body lets the event loop run in between)."""
    parts = [orjson.dumps(r.to_json(), option=orjson.OPT_NON_STR_KEYS) for r in results]
    return b"[" + b",".join(parts) + b"]" if many else parts[0]


def _event(res: GenerateResult, sent: list[int] | None, index: int | None) -> bytes:
    """One server-sent event: ``res`` in full, or what is new since ``sent`` (incremental
    streaming), tagged with its sequence's ``index`` when several share the stream."""
    item = res.to_json()
    if sent is not None:
        item = _delta(item, sent)
    if index is not None:
        item["index"] = index
    return b"data: " + orjson.dumps(item, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


async def stream_events(
    sched: Scheduler, rids: list[str], futs: list[asyncio.Future[Any]], many: bool, incremental: bool
) -> AsyncIterator[bytes]:
    """Server-sent events as SGLang 0.5.23 sends them: by default each sequence's output so far
    as it grows (:meth:`Scheduler.follow`), then its result (with the finish reason); with
    ``--incremental-streaming-output`` what is new in each (:func:`_delta`). Of several
    sequences, interleaved, each event with its ``index``; then ``[DONE]``. A failed sequence
    ends the stream with an ``error`` event; a client that goes away aborts them."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    sent = [[0, 0] for _ in rids] if incremental else None

    async def pump(i: int) -> None:
        try:
            async for res in sched.follow(rids[i], futs[i]):
                await queue.put((i, res))
        except Exception as e:  # the request's outcome, whatever it is, goes to the stream's reader
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(rids))]
    live = len(tasks)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
                continue
            if isinstance(item, Exception):
                yield stream_error(item)
                break
            args = (item, None if sent is None else sent[i], i if many else None)
            if entries(item) < HEAVY_ENTRIES:
                yield _event(*args)
            else:  # off the event loop: /health and other requests keep being served
                yield await asyncio.to_thread(_event, *args)
        yield b"data: [DONE]\n\n"
    finally:  # done, failed, or the client went away (the response is cancelled): stop the rest
        for t in tasks:
            t.cancel()
        for rid, fut in zip(rids, futs, strict=True):
            if not fut.done():
                sched.abort(rid=rid)
        await asyncio.gather(*tasks, return_exceptions=True)
