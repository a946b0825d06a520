"""The reference server's HTTP app: SGLang 0.5.x's native routes over Starlette.

The app is Starlette (the layer FastAPI is built on, without FastAPI's dependency solving and
middleware, which cost about a third of a sim server's CPU per ``/generate``); an unknown route or
method gets FastAPI's ``{"detail": ...}`` body, as SGLang's FastAPI app sends it. A route reads the
body (:func:`read_json`), parses it with its schema from :mod:`protocols.http.sglang` (unknown or
ill-typed fields -> 400 naming the field), checks what needs this server's state
(:mod:`nodes.inference.admission`), hands the work to :class:`~nodes.inference.engine.Engine`, and
answers in SGLang's shapes and status codes (:mod:`nodes.inference.render`, where every error body
is made).

A checkpoint whose architecture is a ``*ForSequenceClassification`` (a reward model) is served as
SGLang serves it: ``/classify`` answers each prompt's scores (``{"embedding": [score],
"meta_info": ...}``, a list for a batch), ``/generate`` is refused with 400, and so is
``/classify`` on a model that generates.

Limits SGLang does not have keep one request from stalling the rest: bodies past
``--max-request-bytes`` get 413, ``n`` past ``--max-n`` and more than ``--max-batch-size``
sequences per ``/generate`` get 400, text prompts are tokenized off the event loop. A request that
fails while it runs gets 500 with the reason; if the scheduler loop dies, requests get 503 and so
does ``/health``.

Authentication is SGLang 0.5.23's (:mod:`protocols.http.auth`, :class:`KeyCheck`): ``--api-key`` guards
normal routes, ``--admin-api-key`` the admin ones (weight updates, pause, abort, flush, ...),
``/health*`` stays open, and a refused request gets 401 ``{"error": "Unauthorized"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from nodes.inference import render
from nodes.inference.admission import (
    ask_logprobs,
    build_seqs,
    classify_prompts,
    per_prompt,
    refuse_unlaunched_features,
)
from nodes.inference.backends.base import Seq
from nodes.inference.engine import VERSION, Engine
from nodes.inference.scheduler import SchedulerStopped
from protocols.http.auth import ServerKeys, decide
from protocols.http.sglang import (
    AbortRequest,
    BeginWeightUpdateRequest,
    ClassifyRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    PauseGenerationRequest,
    ProtocolError,
    SamplingParams,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    classify_result,
    lora_update_body,
)
from rlactors.base.aio import wait_for

__all__ = ["BodyTooLarge", "KeyCheck", "Routes", "create_app", "read_json"]

HEALTH_CHECK_TIMEOUT_S = 20.0


class KeyCheck:
    """ASGI middleware: SGLang's key check (:func:`protocols.http.auth.decide`) before any route runs.
    Pure ASGI, as SGLang's, so a client's disconnect still reaches a running ``/generate``."""

    def __init__(self, app: Any, keys: ServerKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            authorization = header.decode("latin-1") if header is not None else None
            keys = self.keys
            if not decide(scope["method"], scope["path"], authorization, keys.api_key, keys.admin_api_key):
                await render.unauthorized()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    """A request body over ``--max-request-bytes`` (HTTP 413)."""


async def read_json(request: Request, limit: int, allow_empty: bool = False) -> Any:
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


class Routes:
    """The route handlers of one server, over its engine and scheduler."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.sched = engine, engine.scheduler

    async def body(self, request: Request, allow_empty: bool = False) -> Any:
        """The request's JSON body, within ``--max-request-bytes``."""
        return await read_json(request, self.engine.args.max_request_bytes, allow_empty)

    async def generate(self, request: Request) -> Response:
        req = GenerateRequest.from_json(await self.body(request))
        self.engine.refuse_generation()
        refuse_unlaunched_features(req, lora=self.engine.args.enable_lora)
        flags = per_prompt(req.return_logprob, req.prompt_count, "return_logprob", False)
        loras = [
            self.engine.lora_adapter(n)
            for n in per_prompt(req.lora_path, req.prompt_count, "lora_path", None)
        ]
        indexed = await build_seqs(self.engine, req)
        for i, s in indexed:
            s.lora = loras[i]
        seqs = [s for _, s in indexed]
        seen = set()
        for s in seqs:
            if s.rid in self.sched.by_rid or s.rid in seen:
                raise ProtocolError(f"Duplicate request ID detected: {s.rid}")
            seen.add(s.rid)
        ask_logprobs(req, indexed, flags, self.engine.args, self.engine.backend.vocab_size)
        rids = [s.rid for s in seqs]
        futs = []
        try:
            for i, s in indexed:
                futs.append(
                    self.sched.submit(
                        s, flags[i], stream=req.stream, logprob_text=req.return_text_in_logprobs
                    )
                )
        except Exception:  # any failure aborts the submitted sequences, then re-raises
            for rid in rids[: len(futs)]:
                self.sched.abort(rid=rid)
            raise
        if req.stream:
            many = req.is_batch or len(seqs) > 1
            return StreamingResponse(
                render.stream_events(
                    self.sched, rids, futs, many, self.engine.args.incremental_streaming_output
                ),
                media_type="text/event-stream",
            )
        watcher = asyncio.create_task(_abort_on_disconnect(self.engine, request, rids))
        try:
            results = [await futs[0]] if len(futs) == 1 else await asyncio.gather(*futs)
        except Exception:  # any failure aborts the submitted sequences, then re-raises
            for rid in rids:  # one sequence failed: stop its siblings too
                self.sched.abort(rid=rid)
            raise
        finally:
            watcher.cancel()
        many = req.is_batch or len(results) > 1
        if sum(render.entries(r) for r in results) < render.HEAVY_ENTRIES:
            return Response(render.generate_body(results, many), media_type="application/json")
        # a large answer is rendered off the event loop, so /health and other requests are served meanwhile
        content = await asyncio.to_thread(render.generate_body, results, many)
        return Response(content, media_type="application/json")

    async def classify(self, request: Request) -> Response:
        # SGLang: a reward model's scores, in the shape of an embedding model's answer
        start = time.perf_counter()
        req = ClassifyRequest.from_json(await self.body(request))
        self.engine.refuse_classification()
        prompts, rids = await classify_prompts(self.engine, req)
        scores = await self.engine.classify(prompts)
        took = time.perf_counter() - start
        version = self.engine.weight_version
        out = [
            classify_result(rid, s, len(p), version, took)
            for rid, s, p in zip(rids, scores, prompts, strict=True)
        ]
        return render.OrjsonResponse(out if req.is_batch else out[0])

    async def abort_request(self, request: Request) -> Response:
        req = AbortRequest.from_json(await self.body(request, allow_empty=True))
        self.sched.abort(rid=req.rid, abort_all=req.abort_all, message=req.abort_message)
        return Response(status_code=200)

    async def pause_generation(self, request: Request) -> render.OrjsonResponse:
        req = PauseGenerationRequest.from_json(await self.body(request, allow_empty=True))
        await self.sched.pause(req.mode)
        return render.OrjsonResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: Request) -> render.OrjsonResponse:
        ContinueGenerationRequest.from_json(await self.body(request, allow_empty=True))
        self.sched.resume()
        return render.OrjsonResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: Request) -> Response:
        ok = self.sched.flush_cache()
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n",
            status_code=200 if ok else 400,
        )

    async def health_generate(self, request: Request) -> Response:
        if not self.sched.alive:
            return Response(status_code=503)
        if self.engine.classifier is not None:  # SGLang probes a reward model with one prompt too
            try:
                await wait_for(self.engine.classify([[0]]), HEALTH_CHECK_TIMEOUT_S)
            except Exception:  # any failure of the probe means unhealthy
                return Response(status_code=503)
            return Response(status_code=200)
        if self.sched.paused or self.sched.running or self.sched.stepping:
            # the loop is alive and busy: no probe, which would wait behind the step in progress
            return Response(status_code=200)
        seq = Seq(
            rid=f"HEALTH_CHECK_{time.time()}_{uuid.uuid4().hex[:6]}",
            input_ids=[0],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
            seed=0,
        )
        try:
            await wait_for(self.sched.submit(seq, False), HEALTH_CHECK_TIMEOUT_S)
        except Exception:  # any failure of the probe means unhealthy
            self.sched.abort(rid=seq.rid)
            return Response(status_code=503)
        return Response(status_code=200)

    async def model_info(self, request: Request) -> render.OrjsonResponse:
        return render.OrjsonResponse(
            {
                "model_path": self.engine.args.model_path,
                "tokenizer_path": self.engine.args.tokenizer_path or self.engine.args.model_path,
                "is_generation": self.engine.is_generation,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
            }
        )

    async def get_weight_version(self, request: Request) -> render.OrjsonResponse:
        return render.OrjsonResponse({"weight_version": self.engine.weight_version})

    async def update_weight_version(self, request: Request) -> render.OrjsonResponse:
        req = UpdateWeightVersionRequest.from_json(await self.body(request))
        if req.abort_all_requests:
            self.sched.abort(abort_all=True)
        self.engine.set_weight_version(req.new_version)
        return render.OrjsonResponse(
            {
                "success": True,
                "message": f"Weight version updated to {req.new_version}",
                "new_version": req.new_version,
            }
        )

    async def server_info(self, request: Request) -> render.OrjsonResponse:
        return render.OrjsonResponse(self.engine.server_info())

    async def loads(self, request: Request) -> render.OrjsonResponse:
        load = {
            "dp_rank": 0,
            "num_running_reqs": len(self.sched.running),
            "num_waiting_reqs": len(self.sched.waiting),
            "num_used_tokens": sum(len(r.seq.ids) for r in self.sched.running),
            "max_running_requests": self.engine.args.max_running_requests,
            "max_total_num_tokens": self.engine.args.cache_tokens,
        }
        return render.OrjsonResponse(
            {"version": VERSION, "accelerator": None, "num_accelerators": 1, "loads": [load]}
        )

    async def get_weights_by_name(self, request: Request) -> render.OrjsonResponse:
        req = GetWeightsByNameRequest.from_json(await self.body(request))
        ret = self.engine.weights_by_name(req.name, req.truncate_size)
        if ret is None:
            return render.error("Get parameter by name failed")
        return render.OrjsonResponse(ret)

    async def update_weights_from_disk(self, request: Request) -> render.OrjsonResponse:
        req = UpdateWeightsFromDiskRequest.from_json(await self.body(request))
        ok, message = await self.engine.update_from_disk(req)
        return render.ok_or_400(ok, message, num_paused_requests=0)

    async def init_weights_update_group(self, request: Request) -> render.OrjsonResponse:
        req = InitWeightsUpdateGroupRequest.from_json(await self.body(request))
        return render.ok_or_400(*await self.engine.init_group(req))

    async def update_weights_from_distributed(self, request: Request) -> render.OrjsonResponse:
        req = UpdateWeightsFromDistributedRequest.from_json(await self.body(request))
        return render.ok_or_400(*await self.engine.update_from_distributed(req))

    async def update_weights_from_tensor(self, request: Request) -> render.OrjsonResponse:
        req = UpdateWeightsFromTensorRequest.from_json(await self.body(request))
        return render.ok_or_400(*await self.engine.update_from_tensor(req))

    async def destroy_weights_update_group(self, request: Request) -> render.OrjsonResponse:
        req = DestroyWeightsUpdateGroupRequest.from_json(await self.body(request, allow_empty=True))
        return render.ok_or_400(*self.engine.destroy_group(req.group_name))

    async def load_lora_adapter(self, request: Request) -> render.OrjsonResponse:
        req = LoadLoRAAdapterRequest.from_json(await self.body(request))
        ok, error = await self.engine.load_lora(req.lora_name, req.lora_path)
        return _lora_answer(ok, error, self.engine.loaded_adapters())

    async def unload_lora_adapter(self, request: Request) -> render.OrjsonResponse:
        req = UnloadLoRAAdapterRequest.from_json(await self.body(request))
        ok, error = self.engine.unload_lora(req.lora_name)
        return _lora_answer(ok, error, self.engine.loaded_adapters())

    async def begin_weight_update(self, request: Request) -> render.OrjsonResponse:
        req = BeginWeightUpdateRequest.from_json(await self.body(request, allow_empty=True))
        if self.engine.session_open:
            return render.ok_or_400(False, "A weight update session is already in progress.")
        if req.selector != "all":
            return render.ok_or_400(
                False, f"Unsupported selector {req.selector!r}; this server has one model."
            )
        self.engine.session_open = True
        return render.ok_or_400(True, "Weight update session started.")

    async def end_weight_update(self, request: Request) -> render.OrjsonResponse:
        EndWeightUpdateRequest.from_json(await self.body(request, allow_empty=True))
        if not self.engine.session_open:
            return render.ok_or_400(False, "No weight update session is in progress.")
        self.engine.session_open = False
        return render.ok_or_400(True, "Weight update session ended.")


def _lora_answer(ok: bool, error: str | None, loaded: dict[str, str]) -> render.OrjsonResponse:
    # SGLang: LoRAUpdateOutput, 200 on success else 400 (loaded_adapters None after a failure)
    return render.OrjsonResponse(
        lora_update_body(ok, loaded if ok else None, error), status_code=200 if ok else 400
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    # an unknown route or method: FastAPI's body, as SGLang sends it
    assert isinstance(exc, HTTPException)
    return render.OrjsonResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


async def _protocol_error(request: Request, exc: Exception) -> Response:
    return render.error(str(exc))


async def _body_too_large(request: Request, exc: Exception) -> Response:
    return render.error(f"{exc} (--max-request-bytes)", 413)


async def _scheduler_stopped(request: Request, exc: Exception) -> Response:
    return render.error(str(exc), 503)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # a bug, not the client's fault: say what broke (the traceback goes to the log)
    return render.error(f"internal error: {type(exc).__name__}: {exc}", 500)


def create_app(engine: Engine, keys: ServerKeys | None = None) -> Starlette:
    """The app serving ``engine``; the scheduler starts and stops with the app."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.scheduler.start()
        try:
            yield
        finally:
            await engine.scheduler.stop()

    r = Routes(engine)
    routes = [
        Route("/generate", r.generate, methods=["POST", "PUT"]),
        Route("/classify", r.classify, methods=["POST", "PUT"]),  # a reward model's scores
        Route("/abort_request", r.abort_request, methods=["POST"]),
        Route("/pause_generation", r.pause_generation, methods=["POST"]),
        Route("/continue_generation", r.continue_generation, methods=["POST"]),
        Route("/flush_cache", r.flush_cache, methods=["GET", "POST"]),
        # SGLang 0.5.23: /health runs the one-token probe too, by default
        Route("/health", r.health_generate, methods=["GET"]),
        Route("/health_generate", r.health_generate, methods=["GET"]),
        Route("/model_info", r.model_info, methods=["GET"]),
        Route("/get_model_info", r.model_info, methods=["GET"]),  # deprecated in SGLang 0.5.23, still served
        Route("/get_weight_version", r.get_weight_version, methods=["GET"]),
        Route("/update_weight_version", r.update_weight_version, methods=["POST"]),
        Route("/server_info", r.server_info, methods=["GET"]),
        Route(
            "/get_server_info", r.server_info, methods=["GET"]
        ),  # deprecated in SGLang 0.5.23, still served
        Route("/v1/loads", r.loads, methods=["GET"]),
        Route("/get_weights_by_name", r.get_weights_by_name, methods=["GET", "POST"]),
        Route("/update_weights_from_disk", r.update_weights_from_disk, methods=["POST"]),
        Route("/init_weights_update_group", r.init_weights_update_group, methods=["POST"]),
        Route("/update_weights_from_distributed", r.update_weights_from_distributed, methods=["POST"]),
        Route("/update_weights_from_tensor", r.update_weights_from_tensor, methods=["POST"]),
        Route("/destroy_weights_update_group", r.destroy_weights_update_group, methods=["POST"]),
        Route("/begin_weight_update", r.begin_weight_update, methods=["POST"]),
        Route("/end_weight_update", r.end_weight_update, methods=["POST"]),
        Route("/load_lora_adapter", r.load_lora_adapter, methods=["POST"]),
        Route("/unload_lora_adapter", r.unload_lora_adapter, methods=["POST"]),
    ]
    handlers = {
        HTTPException: _http_error,
        ProtocolError: _protocol_error,
        BodyTooLarge: _body_too_large,
        SchedulerStopped: _scheduler_stopped,
        Exception: _internal_error,
    }
    middleware = [Middleware(KeyCheck, keys=keys)] if keys else []
    return Starlette(
        routes=routes,
        exception_handlers=handlers,
        lifespan=lifespan,
        middleware=middleware,
    )
