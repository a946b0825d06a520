"""The reference inference server: SGLang 0.5.x's native HTTP protocol over FastAPI.

Run it the way SGLang is run::

    python -m nodes.inference.server --model-path P --host 127.0.0.1 --port 30000 --backend hf|sim

The app is Starlette (the layer FastAPI is built on, without FastAPI's dependency solving and
middleware, which cost about a third of a sim server's CPU per ``/generate``); an unknown route or
method gets FastAPI's ``{"detail": ...}`` body, as SGLang's FastAPI app sends it. Routes parse
bodies with the schemas of :mod:`protocols.sglang` (unknown or ill-typed fields -> 400
``{"error": {"message": ...}}`` naming the field), hand work to
:class:`~nodes.inference.engine.Engine`, and render SGLang's response shapes and status codes.

Limits SGLang does not have keep one request from stalling the rest: bodies past
``--max-request-bytes`` get 413, ``n`` past ``--max-n`` and more than ``--max-batch-size``
sequences per ``/generate`` get 400, text prompts are tokenized off the event loop. A request that
fails while it runs gets 500 with the reason; if the scheduler loop dies, requests get 503 and so
does ``/health``.

Authentication is SGLang 0.5.23's (:mod:`protocols.auth`): ``--api-key`` guards normal routes,
``--admin-api-key`` the admin ones (weight updates, pause, abort, flush, ...), ``/health*`` stays
open, and a refused request gets 401 ``{"error": "Unauthorized"}``. The keys may come from the
environment instead (``RLACTORS_SERVER_API_KEY``, ``RLACTORS_SERVER_ADMIN_API_KEY``), which other
users cannot read the way they read a command line; the launcher passes them so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse as _StarletteJSON
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from nodes.inference.backends.base import Seq
from nodes.inference.engine import VERSION, Engine, ServerArgs
from nodes.inference.scheduler import SchedulerStopped
from protocols.auth import ServerKeys, decide
from protocols.sglang import (
    AbortRequest,
    BeginWeightUpdateRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    GenerateResult,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    ProtocolError,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    error_body,
    success_body,
)
from rlactors.aio import wait_for

log = structlog.get_logger(__name__)

HEALTH_CHECK_TIMEOUT_S = 20.0
GRACEFUL_SHUTDOWN_S = 10  # on SIGTERM, requests still running after this are cut off


class OrjsonResponse(_StarletteJSON):
    """JSON rendered by orjson, as SGLang renders its responses (``SGLangORJSONResponse``): 1 µs for a
    16-token ``/generate`` answer with logprobs, ``json.dumps`` 16 µs; a NaN or infinite float is
    ``null``, as there."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


class KeyCheck:
    """ASGI middleware: SGLang's key check (:func:`protocols.auth.decide`) before any route runs.
    Pure ASGI, as SGLang's, so a client's disconnect still reaches a running ``/generate``."""

    def __init__(self, app: Any, keys: ServerKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            authorization = header.decode("latin-1") if header is not None else None
            keys = self.keys
            if not decide(scope["method"], scope["path"], authorization, keys.api_key, keys.admin_api_key):
                await OrjsonResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    """A request body over ``--max-request-bytes`` (HTTP 413)."""


def _bad(message: str) -> OrjsonResponse:
    return OrjsonResponse(error_body(message), status_code=400)


def _ok_or_400(ok: bool, message: str, **extra: Any) -> OrjsonResponse:
    return OrjsonResponse(success_body(ok, message, **extra), status_code=200 if ok else 400)


async def _body(request: Request, limit: int, allow_empty: bool = False) -> Any:
    """The JSON body, read up to ``limit`` bytes (:class:`BodyTooLarge` past it)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes is over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        if allow_empty:
            return {}
        raise ProtocolError("request body is empty; expected a JSON object")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, nesting too deep
        raise ProtocolError(f"invalid JSON body: {e}") from None
    if _MAYBE_SURROGATE.search(raw):
        try:
            _refuse_surrogates(data, "")
        except RecursionError:
            raise ProtocolError("invalid JSON body: nested too deeply") from None
    return data


# a UTF-16 surrogate escape (``\ud800``), or one encoded as UTF-8, which json.loads lets through
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _refuse_surrogates(value: Any, where: str) -> None:
    """400 naming the first string with a lone surrogate: legal JSON, but no text (it cannot be
    tokenized, logged or sent back). SGLang's JSON parser refuses the body the same way (400,
    "no low surrogate in string"). A surrogate pair is one character by then and passes."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise ProtocolError(
                    f"invalid JSON body: {where or 'the body'}: no low surrogate in string "
                    "(a lone UTF-16 surrogate is not text)"
                ) from None
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _refuse_surrogates(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            name = k.encode("utf-8", "backslashreplace").decode()  # the message must be text itself
            key = f"{where}.{name}" if where else name
            _refuse_surrogates(k, key)
            _refuse_surrogates(v, key)


def _per_prompt(value: Any, count: int, name: str, default: Any) -> list[Any]:
    """A batch field: a list must have one entry per prompt; a single value applies to all."""
    if not isinstance(value, list):
        return [default if value is None else value] * count
    if len(value) != count:
        raise ProtocolError(f"{name}: {len(value)} entries for {count} prompts; give one per prompt")
    return value


def _check_vocab(ids: list[int], vocab: int, where: str) -> None:
    """400 naming the first token id outside ``[0, vocab)``."""
    if min(ids) < 0 or max(ids) >= vocab:  # in C; the scan below only names the first bad id
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise ProtocolError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab})")


async def _build_seqs(engine: Engine, req: GenerateRequest) -> list[tuple[int, Seq]]:
    """Expand a (possibly batched, possibly n > 1) request into sequences, within the limits;
    each with the index of its prompt."""
    count, args = req.prompt_count, engine.args
    sps = _per_prompt(req.sampling_params, count, "sampling_params", SamplingParams())
    rids = _per_prompt(req.rid, count, "rid", None)
    for i, sp in enumerate(sps):
        if sp.n > args.max_n:
            where = f"sampling_params[{i}]" if isinstance(req.sampling_params, list) else "sampling_params"
            raise ProtocolError(f"{where}.n: {sp.n} is over this server's limit of {args.max_n} (--max-n)")
        _check_sampling(sp, engine.backend.vocab_size)
    total = sum(sp.n for sp in sps)
    if total > args.max_batch_size:
        raise ProtocolError(
            f"the request expands to {total} sequences (prompts x n), over this server's limit of "
            f"{args.max_batch_size} (--max-batch-size); split it into smaller requests"
        )
    if req.text is not None:
        texts = [engine.fit_text(t) for t in (req.text if isinstance(req.text, list) else [req.text])]
        prompts = await engine.tokenize(texts)
    else:
        prompts = req.input_ids if req.is_batch else [req.input_ids]  # type: ignore[list-item]
    seqs = []
    for i, (ids, sp, rid) in enumerate(zip(prompts, sps, rids, strict=True)):
        field = "text" if req.text is not None else "input_ids"
        where = f"{field}[{i}]" if req.is_batch else field
        if not ids:
            raise ProtocolError(f"{where}: the prompt is empty")
        sp = sp.model_copy()  # check_length may cut max_new_tokens of this prompt only
        ids = list(ids)
        engine.check_length(ids, sp)
        _check_vocab(ids, engine.backend.vocab_size, where)
        for j in range(sp.n):
            if rid is None:
                this_rid = uuid.uuid4().hex
            elif sp.n > 1 or (req.is_batch and not isinstance(req.rid, list)):
                this_rid = f"{rid}_{i}_{j}" if req.is_batch else f"{rid}_{j}"
            else:
                this_rid = str(rid)
            seed = sp.sampling_seed if sp.sampling_seed is not None else engine.rng.getrandbits(63)
            seqs.append((i, Seq(rid=this_rid, input_ids=list(ids), params=sp, seed=seed + j)))
    return seqs


MAX_STOP_COUNT = 32  # SGLang's limits on stop strings and stop_regex patterns per request
MAX_STOP_REGEX_LEN = 256  # bytes
GRAMMAR_REFUSED = (
    "Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not supported when the "
    "server is launched with --grammar-backend none"
)


def _check_sampling(sp: SamplingParams, vocab: int) -> None:
    """What SGLang 0.5.23 checks once it knows the tokenizer and model, in its words: stop and
    stop_regex counts and sizes, logit_bias keys (token ids as strings), and no grammar (this
    server has no grammar backend: SGLang launched with ``--grammar-backend none`` refuses them
    so; an empty one is none). A stop_regex that does not compile is refused here; SGLang
    answers it with 500."""
    if len(sp.stop_strings) > MAX_STOP_COUNT:
        raise ProtocolError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(sp.stop_strings)}")
    patterns = sp.stop_patterns
    if len(patterns) > MAX_STOP_COUNT:
        raise ProtocolError(f"at most {MAX_STOP_COUNT} stop_regex patterns are allowed, got {len(patterns)}")
    for pattern in patterns:
        size = len(pattern.encode())
        if size > MAX_STOP_REGEX_LEN:
            raise ProtocolError(f"stop_regex is {size} bytes, over the {MAX_STOP_REGEX_LEN}-byte limit")
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as e:
            raise ProtocolError(f"invalid stop_regex {pattern!r}: {e}") from None
    for key in sp.logit_bias or {}:
        try:
            token = int(key)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        if not 0 <= token < vocab:
            raise ProtocolError(f"logit_bias must has keys in [0, {vocab - 1}], got {key}.")
    if sp.json_schema or sp.regex or sp.ebnf or sp.structural_tag:
        raise ProtocolError(GRAMMAR_REFUSED)


def _refuse_unlaunched_features(req: GenerateRequest) -> None:
    """Fields that ask for what this server never serves get the 400 SGLang 0.5.23 gives when it
    was launched without the feature (its words): hidden states, a custom logit processor, a LoRA
    adapter, a data-parallel rank other than 0, a session. Without this they would be ignored."""

    def asked(value: Any) -> bool:
        return any(value) if isinstance(value, list) else bool(value)

    if asked(req.return_hidden_states):
        raise ProtocolError(
            "The server is not configured to return hidden states. Please set `--return-hidden-states-mode "
            "last`, `--return-hidden-states-mode full`, or the legacy `--enable-return-hidden-states` flag."
        )
    if asked(req.custom_logit_processor):
        raise ProtocolError(
            "The server is not configured to enable custom logit processor. "
            "Please set `--enable-custom-logit-processor` to enable this feature."
        )
    if req.lora_path:  # SGLang tests the field itself: a list of nulls is "requested" too
        lora = req.lora_path
        first = lora if isinstance(lora, str) else next((a for a in lora if a), None)
        raise ProtocolError(
            f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server "
            "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
        )
    rank = req.routed_dp_rank if req.routed_dp_rank is not None else req.data_parallel_rank
    if rank is not None and rank != 0:  # one data-parallel rank
        raise ProtocolError(f"routed_dp_rank={rank} out of range [0, 1)")
    if isinstance(req.session_params, dict) and req.session_params.get("id") is not None:
        raise ProtocolError(f"Invalid request: session id {req.session_params['id']} does not exist")


def _ask_logprobs(
    req: GenerateRequest, indexed: list[tuple[int, Seq]], flags: list[bool], args: ServerArgs, vocab: int
) -> None:
    """Hand each sequence of a ``return_logprob`` prompt the extra log-probs it asks for
    (``logprob_start_len``, ``top_logprobs_num``, ``token_ids_logprob``); SGLang ignores them
    without ``return_logprob``. A request whose extras add up past ``--max-logprob-entries`` is
    refused: its answer alone could stall the server and fill memory."""
    count = req.prompt_count
    starts = _per_prompt(req.logprob_start_len, count, "logprob_start_len", -1)
    tops = _per_prompt(req.top_logprobs_num, count, "top_logprobs_num", 0)
    ids = req.token_ids_logprob
    if ids is None or not ids or isinstance(ids[0], int):  # one list for every prompt
        per_ids: list[Any] = [ids] * count
    elif not req.is_batch:  # SGLang's words for [[...]] with one prompt
        raise ProtocolError("token_ids_logprob must be a flat list of integers.")
    else:
        per_ids = _per_prompt(ids, count, "token_ids_logprob", None)
    per_ids = [want or None for want in per_ids]  # an empty list asks for none, as in SGLang
    for want in per_ids:
        if want:
            _check_vocab(want, vocab, "token_ids_logprob")
    entries = 0
    for i, seq in indexed:
        if not flags[i]:
            continue
        n, start = len(seq.input_ids), starts[i]
        if start > n:  # SGLang's words
            raise ProtocolError(
                f"req.logprob_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={n}. Please use a smaller logprob_start_len."
            )
        seq.logprob_start = start if 0 <= start < n else None  # -1 (or the prompt's end): none
        seq.top_logprobs = min(max(0, tops[i]), vocab)
        seq.token_ids_logprob = None if per_ids[i] is None else list(per_ids[i])
        positions = (seq.params.max_new_tokens or 0) + (
            0 if seq.logprob_start is None else n - seq.logprob_start
        )
        entries += positions * (seq.top_logprobs + len(seq.token_ids_logprob or ()))
    if entries > args.max_logprob_entries:
        raise ProtocolError(
            f"the request asks for {entries} log-prob entries (top_logprobs_num and token_ids_logprob "
            f"at each reported position, x n, x prompts), over this server's limit of "
            f"{args.max_logprob_entries} (--max-logprob-entries); ask for fewer top log-probs, "
            "tokens or sequences per request"
        )


async def _abort_on_disconnect(engine: Engine, request: Request, rids: list[str]) -> None:
    """SGLang aborts a request whose client went away; so do we (frees the rid for a retry).

    After the body is read, the ASGI ``receive`` only returns once the client disconnects, so
    this waits without polling; it is cancelled when the response is ready.
    """
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            for rid in rids:
                engine.scheduler.abort(rid=rid)
            return


# meta_info lists that hold one entry per output token: an incremental stream event sends only the new ones
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


def _entries(res: GenerateResult) -> int:
    """How many log-prob entries rendering ``res`` makes (0 without ``return_logprob``)."""
    lp = res.logprobs
    if lp is None:
        return 0
    width = 1 + (len(lp.output_top[0]) if lp.output_top else 0) + len(lp.token_ids or ())
    return (len(lp.output) + len(lp.input)) * width


def _body_bytes(results: list[GenerateResult], many: bool) -> bytes:
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


async def _stream(
    engine: Engine, rids: list[str], futs: list[asyncio.Future[Any]], many: bool
) -> AsyncIterator[bytes]:
    """Server-sent events as SGLang 0.5.23 sends them: by default each sequence's output so far
    as it grows (:meth:`Scheduler.follow`), then its result (with the finish reason); with
    ``--incremental-streaming-output`` what is new in each (:func:`_delta`). Of several
    sequences, interleaved, each event with its ``index``; then ``[DONE]``. A failed sequence
    ends the stream with an ``error`` event; a client that goes away aborts them."""
    sched = engine.scheduler
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    sent = [[0, 0] for _ in rids] if engine.args.incremental_streaming_output else None

    async def pump(i: int) -> None:
        try:
            async for res in sched.follow(rids[i], futs[i]):
                await queue.put((i, res))
        except Exception as e:
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
                code = 400 if isinstance(item, ProtocolError) else 500
                err = {"message": str(item), "type": "invalid_request_error" if code == 400 else "server_error",
                       "code": code, "retryable": False}  # fmt: skip
                yield b"data: " + orjson.dumps({"error": err}) + b"\n\n"
                break
            args = (item, None if sent is None else sent[i], i if many else None)
            if _entries(item) < HEAVY_ENTRIES:
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


def create_app(engine: Engine, keys: ServerKeys | None = None) -> Starlette:
    """The app serving ``engine``; the scheduler starts and stops with the app."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.scheduler.start()
        try:
            yield
        finally:
            await engine.scheduler.stop()

    sched = engine.scheduler
    limit = engine.args.max_request_bytes

    async def body(request: Request, allow_empty: bool = False) -> Any:
        return await _body(request, limit, allow_empty)

    async def http_error(request: Request, exc: Exception) -> Response:
        # an unknown route or method: FastAPI's body, as SGLang sends it
        assert isinstance(exc, HTTPException)
        return OrjsonResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    async def protocol_error(request: Request, exc: Exception) -> OrjsonResponse:
        return _bad(str(exc))

    async def body_too_large(request: Request, exc: Exception) -> OrjsonResponse:
        return OrjsonResponse(error_body(f"{exc} (--max-request-bytes)"), status_code=413)

    async def scheduler_stopped(request: Request, exc: Exception) -> OrjsonResponse:
        return OrjsonResponse(error_body(str(exc)), status_code=503)

    async def internal_error(request: Request, exc: Exception) -> OrjsonResponse:
        # a bug, not the client's fault: say what broke (the traceback goes to the log)
        return OrjsonResponse(error_body(f"internal error: {type(exc).__name__}: {exc}"), status_code=500)

    async def generate(request: Request) -> Response:
        req = GenerateRequest.from_json(await body(request))
        _refuse_unlaunched_features(req)
        flags = _per_prompt(req.return_logprob, req.prompt_count, "return_logprob", False)
        indexed = await _build_seqs(engine, req)
        seqs = [s for _, s in indexed]
        seen = set()
        for s in seqs:
            if s.rid in sched.by_rid or s.rid in seen:
                raise ProtocolError(f"Duplicate request ID detected: {s.rid}")
            seen.add(s.rid)
        _ask_logprobs(req, indexed, flags, engine.args, engine.backend.vocab_size)
        rids = [s.rid for s in seqs]
        futs = []
        try:
            for i, s in indexed:
                futs.append(
                    sched.submit(s, flags[i], stream=req.stream, logprob_text=req.return_text_in_logprobs)
                )
        except Exception:
            for rid in rids[: len(futs)]:
                sched.abort(rid=rid)
            raise
        if req.stream:
            many = req.is_batch or len(seqs) > 1
            return StreamingResponse(_stream(engine, rids, futs, many), media_type="text/event-stream")
        watcher = asyncio.create_task(_abort_on_disconnect(engine, request, rids))
        try:
            results = [await futs[0]] if len(futs) == 1 else await asyncio.gather(*futs)
        except Exception:
            for rid in rids:  # one sequence failed: stop its siblings too
                sched.abort(rid=rid)
            raise
        finally:
            watcher.cancel()
        many = req.is_batch or len(results) > 1
        if sum(_entries(r) for r in results) < HEAVY_ENTRIES:
            return Response(_body_bytes(results, many), media_type="application/json")
        # a large answer is rendered off the event loop, so /health and other requests are served meanwhile
        content = await asyncio.to_thread(_body_bytes, results, many)
        return Response(content, media_type="application/json")

    async def abort_request(request: Request) -> Response:
        req = AbortRequest.from_json(await body(request, allow_empty=True))
        sched.abort(rid=req.rid, abort_all=req.abort_all, message=req.abort_message)
        return Response(status_code=200)

    async def pause_generation(request: Request) -> OrjsonResponse:
        req = PauseGenerationRequest.from_json(await body(request, allow_empty=True))
        await sched.pause(req.mode)
        return OrjsonResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request: Request) -> OrjsonResponse:
        await body(request, allow_empty=True)
        sched.resume()
        return OrjsonResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(request: Request) -> Response:
        ok = sched.flush_cache()
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n",
            status_code=200 if ok else 400,
        )

    async def health_generate(request: Request) -> Response:
        if not sched.alive:
            return Response(status_code=503)
        if sched.paused or sched.running or sched.stepping:
            # the loop is alive and busy: no probe, which would wait behind the step in progress
            return Response(status_code=200)
        seq = Seq(
            rid=f"HEALTH_CHECK_{time.time()}_{uuid.uuid4().hex[:6]}",
            input_ids=[0],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
            seed=0,
        )
        try:
            await wait_for(sched.submit(seq, False), HEALTH_CHECK_TIMEOUT_S)
        except Exception:
            sched.abort(rid=seq.rid)
            return Response(status_code=503)
        return Response(status_code=200)

    async def model_info(request: Request) -> OrjsonResponse:
        return OrjsonResponse(
            {
                "model_path": engine.args.model_path,
                "tokenizer_path": engine.args.tokenizer_path or engine.args.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": engine.weight_version,
            }
        )

    async def get_weight_version(request: Request) -> OrjsonResponse:
        return OrjsonResponse({"weight_version": engine.weight_version})

    async def update_weight_version(request: Request) -> OrjsonResponse:
        req = UpdateWeightVersionRequest.from_json(await body(request))
        if req.abort_all_requests:
            sched.abort(abort_all=True)
        engine.set_weight_version(req.new_version)
        return OrjsonResponse(
            {
                "success": True,
                "message": f"Weight version updated to {req.new_version}",
                "new_version": req.new_version,
            }
        )

    async def server_info(request: Request) -> OrjsonResponse:
        return OrjsonResponse(engine.server_info())

    async def loads(request: Request) -> OrjsonResponse:
        load = {
            "dp_rank": 0,
            "num_running_reqs": len(sched.running),
            "num_waiting_reqs": len(sched.waiting),
            "num_used_tokens": sum(len(r.seq.ids) for r in sched.running),
            "max_running_requests": engine.args.max_running_requests,
            "max_total_num_tokens": engine.args.cache_tokens,
        }
        return OrjsonResponse(
            {"version": VERSION, "accelerator": None, "num_accelerators": 1, "loads": [load]}
        )

    async def get_weights_by_name(request: Request) -> OrjsonResponse:
        req = GetWeightsByNameRequest.from_json(await body(request))
        ret = engine.weights_by_name(req.name, req.truncate_size)
        if ret is None:
            return _bad("Get parameter by name failed")
        return OrjsonResponse(ret)

    async def update_weights_from_disk(request: Request) -> OrjsonResponse:
        req = UpdateWeightsFromDiskRequest.from_json(await body(request))
        ok, message = await engine.update_from_disk(req)
        return _ok_or_400(ok, message, num_paused_requests=0)

    async def init_weights_update_group(request: Request) -> OrjsonResponse:
        req = InitWeightsUpdateGroupRequest.from_json(await body(request))
        return _ok_or_400(*await engine.init_group(req))

    async def update_weights_from_distributed(request: Request) -> OrjsonResponse:
        req = UpdateWeightsFromDistributedRequest.from_json(await body(request))
        return _ok_or_400(*await engine.update_from_distributed(req))

    async def update_weights_from_tensor(request: Request) -> OrjsonResponse:
        req = UpdateWeightsFromTensorRequest.from_json(await body(request))
        return _ok_or_400(*await engine.update_from_tensor(req))

    async def destroy_weights_update_group(request: Request) -> OrjsonResponse:
        req = DestroyWeightsUpdateGroupRequest.from_json(await body(request, allow_empty=True))
        return _ok_or_400(*engine.destroy_group(req.group_name))

    async def begin_weight_update(request: Request) -> OrjsonResponse:
        req = BeginWeightUpdateRequest.from_json(await body(request, allow_empty=True))
        if engine.session_open:
            return _ok_or_400(False, "A weight update session is already in progress.")
        if req.selector != "all":
            return _ok_or_400(False, f"Unsupported selector {req.selector!r}; this server has one model.")
        engine.session_open = True
        return _ok_or_400(True, "Weight update session started.")

    async def end_weight_update(request: Request) -> OrjsonResponse:
        EndWeightUpdateRequest.from_json(await body(request, allow_empty=True))
        if not engine.session_open:
            return _ok_or_400(False, "No weight update session is in progress.")
        engine.session_open = False
        return _ok_or_400(True, "Weight update session ended.")

    routes = [
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/pause_generation", pause_generation, methods=["POST"]),
        Route("/continue_generation", continue_generation, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        # SGLang 0.5.23: /health runs the one-token probe too, by default
        Route("/health", health_generate, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),  # deprecated in SGLang 0.5.23, still served
        Route("/get_weight_version", get_weight_version, methods=["GET"]),
        Route("/update_weight_version", update_weight_version, methods=["POST"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),  # deprecated in SGLang 0.5.23, still served
        Route("/v1/loads", loads, methods=["GET"]),
        Route("/get_weights_by_name", get_weights_by_name, methods=["GET", "POST"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/init_weights_update_group", init_weights_update_group, methods=["POST"]),
        Route("/update_weights_from_distributed", update_weights_from_distributed, methods=["POST"]),
        Route("/update_weights_from_tensor", update_weights_from_tensor, methods=["POST"]),
        Route("/destroy_weights_update_group", destroy_weights_update_group, methods=["POST"]),
        Route("/begin_weight_update", begin_weight_update, methods=["POST"]),
        Route("/end_weight_update", end_weight_update, methods=["POST"]),
    ]
    handlers = {
        HTTPException: http_error,
        ProtocolError: protocol_error,
        BodyTooLarge: body_too_large,
        SchedulerStopped: scheduler_stopped,
        Exception: internal_error,
    }
    middleware = [Middleware(KeyCheck, keys=keys)] if keys else []
    return Starlette(
        routes=routes,
        exception_handlers=handlers,  # type: ignore[arg-type]
        lifespan=lifespan,
        middleware=middleware,
    )


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """SGLang-style flags (``--model-path``, ``--port``, ...) for every :class:`ServerArgs` field."""
    parser = argparse.ArgumentParser(
        prog="python -m nodes.inference.server", description=__doc__.split("\n")[0]
    )
    helps = {
        "model_path": "model folder or Hugging Face id (sim: optional, for its tokenizer)",
        "tokenizer_path": "tokenizer folder or id, if not the model's",
        "host": "address to listen on",
        "port": "port to listen on",
        "backend": "hf: a real model with transformers; sim: a simulated one (timings below)",
        "max_running_requests": "sequences decoded at once; more wait in the queue",
        "cache_tokens": "prefix-cache budget, in tokens",
        "dtype": "auto | float32 | bfloat16 | float16",
        "device": "auto | cpu | cuda | cuda:N",
        "random_seed": "seed for sampling",
        "weight_version": "the weight version reported before the first update",
        "strict_weight_update_session": "refuse distributed weight updates outside "
        "/begin_weight_update ... /end_weight_update, as SGLang 0.5.23",
        "sim_prefill_s_per_token": "sim: seconds of prefill per prompt token",
        "sim_decode_s_base": "sim: seconds per decode step",
        "sim_decode_s_per_seq": "sim: extra seconds per decode step for each running sequence",
        "sim_eos_prob": "sim: chance that a step emits EOS",
        "sim_vocab_size": "sim: vocabulary size without a tokenizer",
        "num_threads": "torch intra-op threads (0: torch's default)",
        "context_length": "longest prompt + max_new_tokens (0: the model's max_position_embeddings, else 32768)",
        "allow_auto_truncate": "truncate prompts past the context length instead of answering 400",
        "max_request_bytes": "request bodies larger than this get 413",
        "max_n": "largest n (samples per prompt) one request may ask for; more get 400",
        "max_batch_size": "most sequences (prompts x n) in one /generate; more get 400",
        "max_logprob_entries": "most log-prob entries one /generate may ask for "
        "(top_logprobs_num x n x new tokens, summed); more get 400",
        "incremental_streaming_output": "stream events carry only what is new, as SGLang's flag",
        "log_level": "debug | info | warning | error",
    }
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        text = helps.get(f.name, "(no description yet)")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        else:
            typ = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=typ, default=f.default, help=text + " (default: %(default)s)")
    _key_flags(parser)
    ns = vars(parser.parse_args(argv))
    del ns["api_key"], ns["admin_api_key"]  # not server arguments: /server_info must not show them
    return ServerArgs(**ns)


def _key_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key",
        default=os.environ.get("RLACTORS_SERVER_API_KEY", ""),
        help="the key normal routes need (default: $RLACTORS_SERVER_API_KEY; none: open)",
    )
    parser.add_argument(
        "--admin-api-key",
        default=os.environ.get("RLACTORS_SERVER_ADMIN_API_KEY", ""),
        help="the key admin routes need, instead of --api-key (default: $RLACTORS_SERVER_ADMIN_API_KEY)",
    )


def parse_keys(argv: list[str] | None = None) -> ServerKeys:
    """The keys the command line (or the environment) gives the server."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _key_flags(parser)
    ns, _ = parser.parse_known_args(argv)
    return ServerKeys(ns.api_key, ns.admin_api_key)


def main(argv: list[str] | None = None) -> None:
    """Load the backend, then serve until interrupted."""
    import logging

    import uvicorn

    args = parse_args(argv)
    level = getattr(logging, args.log_level.upper(), logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(min(level, logging.INFO)))
    keys = parse_keys(argv)
    engine = Engine(args)
    needs = ",".join(k for k in ("api_key", "admin_api_key") if getattr(keys, k)) or "none"
    log.info(
        "server_starting",
        host=args.host,
        port=args.port,
        backend=args.backend,
        model=args.model_path,
        keys=needs,
    )
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    uvicorn.run(
        create_app(engine, keys),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        loop=loop,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


if __name__ == "__main__":
    main()
