"""Continuous batching over a backend, with a prefix cache, abort and pause/continue.

One loop task owns the model. Each iteration either prefills newly admitted requests (they
join the running batch) or advances every running request by one decode step, so requests
join and leave between steps. Aborts, pauses and weight updates take ``step_lock``, which a
step holds, so they act on step boundaries and never race a forward pass. Finished and aborted
requests put the KV of ``(prompt + output)[:-1]`` into the radix cache, so a resumed request
(prompt + tokens so far) skips that prefill.

Every sampled token is recorded with the ``weight_version`` of the model that sampled it (read
once per step; weight updates take ``step_lock``, so they land between steps). A request held
across an update (pause ``retract`` / ``in_place``, or no pause at all) therefore reports which of
its tokens came from which weights, in SGLang's ``meta_info.weight_versions`` spans.

A request whose processing raises fails alone (its future gets the exception); the loop goes on.
Should the loop itself die, it logs why and fails every request in flight, ``alive`` turns false
(``/health`` answers 503) and :meth:`Scheduler.submit` refuses new work with
:class:`SchedulerStopped`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import re
import re._parser as re_parser  # type: ignore[import-not-found]  # typeshed stubs only sre_parse, its old name
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from nodes.inference.backends.base import Backend, Sample, Seq
from nodes.inference.radix import RadixCache
from protocols.http.sglang import (
    ABORT_RUNNING_MESSAGE,
    ABORT_WAITING_MESSAGE,
    GenerateResult,
    LogprobReport,
    ProtocolError,
    finish_abort,
    finish_length,
    finish_stop,
)

log = structlog.get_logger(__name__)


@functools.cache
def _regex_tail_tokens(pattern: str) -> int:
    """How many output tokens a ``stop_regex`` is searched in: one more than the most characters
    it can match (a token holds at least one), as SGLang bounds it; unbounded: all of them."""
    width = re_parser.parse(pattern).getwidth()[1]
    return width + 1 if width < 1 << 20 else 1 << 30


class SchedulerStopped(RuntimeError):
    """The scheduler loop is not running (it crashed, or the server is shutting down)."""


@dataclass(eq=False)
class Req:
    """A request in flight: the backend's :class:`Seq` plus what the server must answer."""

    seq: Seq
    return_logprob: bool
    future: asyncio.Future[GenerateResult]
    created: float = field(default_factory=time.monotonic)
    cached_tokens: int | None = None  # reported: cache hits summed over its prefills (SGLang's sum)
    token_versions: list[str] = field(default_factory=list)  # weight_version that sampled each output token
    prefilled: bool = False
    abort_message: str | None = None
    finish_reason: dict[str, Any] | None = None
    retractions: int = 0  # times a retract pause sent it back to the queue (SGLang's num_retractions)
    progress: asyncio.Event | None = None  # streamed requests: set when a step adds output tokens
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)  # top_logprobs_num, per token
    output_ids_lp: list[list[float]] = field(default_factory=list)  # token_ids_logprob, per token
    logprob_text: bool = False  # return_text_in_logprobs

    @property
    def rid(self) -> str:
        """The request id."""
        return self.seq.rid


class Scheduler:
    """Queues, batching and the prefix cache for one backend."""

    def __init__(
        self,
        backend: Backend,
        cache: RadixCache,
        max_running: int = 64,
        weight_version: str = "default",
    ) -> None:
        self.backend = backend
        self.cache = cache
        self.max_running = max_running
        self.weight_version = weight_version
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.by_rid: dict[str, Req] = {}
        self.paused = False
        self.step_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._pending_aborts = False
        self._task: asyncio.Task[None] | None = None
        self.crash: BaseException | None = None  # why the loop died, if it did
        self.steps = 0
        self.stepping = False  # a prefill or decode step is in progress
        self.prefill_tokens = 0  # tokens actually computed in prefill (not served by the cache)

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop task on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler")

    async def stop(self) -> None:
        """Stop the loop and fail everything still in flight."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # a crash was logged already
                await self._task
        self._fail_all(SchedulerStopped("server shutting down"))

    def _fail_all(self, exc: Exception) -> None:
        for req in list(self.by_rid.values()):
            self._fail(req, exc)
        self.waiting.clear()
        self.running = []

    @property
    def alive(self) -> bool:
        """True while the loop task runs."""
        return self._task is not None and not self._task.done()

    # ---- requests --------------------------------------------------------------------

    def submit(
        self, seq: Seq, return_logprob: bool, stream: bool = False, logprob_text: bool = False
    ) -> asyncio.Future[GenerateResult]:
        """Queue a request; its future resolves when it finishes or is aborted. With ``stream``,
        :meth:`follow` can report its output as it grows; ``logprob_text``: each log-prob entry
        carries its token's text (``return_text_in_logprobs``)."""
        if self._task is not None and self._task.done():
            raise SchedulerStopped(
                f"the scheduler loop has stopped ({self.crash!r}); see the server log and restart the server"
            )
        if seq.rid in self.by_rid:
            raise ProtocolError(f"Duplicate request ID detected: {seq.rid}")
        fut: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        req = Req(
            seq=seq,
            return_logprob=return_logprob,
            future=fut,
            progress=asyncio.Event() if stream else None,
            logprob_text=logprob_text,
        )
        self.by_rid[seq.rid] = req
        if seq.params.max_new_tokens == 0 and not (return_logprob and seq.wants_input):
            req.cached_tokens = self.cache.match(seq.input_ids[:-1]).length
            req.finish_reason = finish_length(0)
            self._resolve(req)
            return fut
        self.waiting.append(req)
        self._wake.set()
        return fut

    async def follow(self, rid: str, fut: asyncio.Future[GenerateResult]) -> AsyncIterator[GenerateResult]:
        """A streamed request's output so far (cumulative, as SGLang streams by default: text, ids
        and logprobs from the first token, no finish reason), then its result. As SGLang: the first
        token at once, then whenever ``stream_interval`` (default 1) tokens are unsent, holding
        output whose text ends in the start of a stop string. Steps taken while the reader was busy
        are sent as one."""
        req = self.by_rid.get(rid)
        if req is not None and req.future is fut and req.progress is not None:
            interval = req.seq.params.stream_interval or 1
            sent = 0
            while not fut.done():
                waiter: asyncio.Future[Any] = asyncio.ensure_future(req.progress.wait())
                try:
                    await asyncio.wait([fut, waiter], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                req.progress.clear()
                n = len(req.seq.output_ids)
                due = n > sent and (sent == 0 or n - sent >= interval)
                if not fut.done() and due and not self._ends_in_stop_prefix(req):
                    sent = n
                    yield self._result(req, partial=True)
        yield await fut

    def _ends_in_stop_prefix(self, req: Req) -> bool:
        """The output's tail holds a stop string, or ends in the start of one (SGLang's
        ``check_match_stop_str_prefix``: a stream does not show what the stop may cut)."""
        p = req.seq.params
        if not p.stop_strings:
            return False
        tail = self.backend.detokenize(req.seq.output_ids[-16:], p.skip_special_tokens)
        return any(
            s in tail or any(tail.endswith(s[:i]) for i in range(1, min(len(tail), len(s)) + 1))
            for s in p.stop_strings
            if s
        )

    def abort(self, rid: str = "", abort_all: bool = False, message: str | None = None) -> int:
        """Abort in-flight requests whose rid starts with ``rid`` (all with ``abort_all``)."""
        n = 0
        for req in list(self.by_rid.values()):
            if abort_all or (rid and req.rid.startswith(rid)):
                n += 1
                self._mark_abort(req, message)
        return n

    def _mark_abort(self, req: Req, message: str | None) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
            req.finish_reason = finish_abort(message or ABORT_WAITING_MESSAGE)
            self._finish(req)
        elif req.abort_message is None:
            req.abort_message = message or ABORT_RUNNING_MESSAGE
            self._pending_aborts = True
            self._wake.set()

    async def pause(self, mode: str) -> None:
        """Pause generation: ``abort`` returns everything, ``retract`` requeues running
        requests (their KV goes to the cache), ``in_place`` freezes them with their KV."""
        async with self.step_lock:
            self.paused = True
            if mode == "abort":
                self.abort(abort_all=True)
                self._reap_aborts()
            elif mode == "retract":
                for req in reversed(self.running):
                    req.retractions += 1
                    self._cache_kv(req)
                    self.waiting.appendleft(req)
                self.running = []
        log.info("generation_paused", mode=mode, running=len(self.running), waiting=len(self.waiting))

    def resume(self) -> None:
        """Continue after :meth:`pause`."""
        self.paused = False
        self._wake.set()
        log.info("generation_continued")

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests run, or wait outside a pause.

        SGLang's rule (``Scheduler.flush_cache``): requests retracted by a pause may wait, so a
        flush works under ``abort`` and ``retract`` pauses, never under ``in_place`` or no pause
        while anything runs.
        """
        if self.running or (self.waiting and not self.paused):
            return False
        self.cache.flush()
        return True

    # ---- the loop --------------------------------------------------------------------

    def _has_work(self) -> bool:
        return self._pending_aborts or (not self.paused and bool(self.waiting or self.running))

    async def _loop(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # whatever ended the loop is kept and given to every waiting request
            self.crash = e
            log.exception("scheduler_loop_crashed", running=len(self.running), waiting=len(self.waiting))
            self._fail_all(SchedulerStopped(f"the scheduler loop crashed: {e!r}"))
            raise

    async def _run(self) -> None:
        while True:
            did = False
            async with self.step_lock:
                self._reap_aborts()
                if not self.paused:
                    self.stepping = True
                    try:
                        did = await self._step()
                    finally:
                        self.stepping = False
                    self._reap_aborts()
            if not did and not self._has_work():
                self._wake.clear()
                await self._wake.wait()  # idle until a request, abort or continue arrives
            else:
                await asyncio.sleep(0)  # let HTTP handlers run between steps

    async def _step(self) -> bool:
        room = self.max_running - len(self.running)
        admit: list[Req] = []
        while self.waiting and len(admit) < room:
            admit.append(self.waiting.popleft())
        version = self.weight_version  # the weights this step samples with (updates wait for step_lock)
        if admit:
            for req in admit:
                ids = req.seq.ids
                # the prompt's log-probs are computed from logprob_start on: no cache before it (SGLang's rule)
                start = req.seq.logprob_start if req.seq.wants_input else None
                cut = len(ids) - 1 if start is None else min(start, len(ids) - 1)
                # KV made with a LoRA adapter is that adapter's alone: such requests skip the cache
                match = self.cache.match(ids[: 0 if req.seq.lora is not None else cut])
                req.seq.cached_len, req.seq.cached_kv = match.length, match.kv
                # SGLang adds each prefill's hit (a retracted request's re-prefill counts again)
                req.cached_tokens = (req.cached_tokens or 0) + match.length
                self.prefill_tokens += len(ids) - match.length
            try:
                samples = await self.backend.prefill([r.seq for r in admit])
            except Exception as e:  # a failed forward fails these requests, not the server
                log.exception("prefill_failed")
                for req in admit:
                    self._fail(req, e)
                return True
            for req in admit:
                req.seq.cached_kv = None
                req.prefilled = True
            self.running.extend(admit)
            self._advance(admit, samples, version)
        elif self.running:
            batch = list(self.running)
            try:
                samples = await self.backend.decode([r.seq for r in batch])
            except Exception as e:  # a backend's failure fails the batch's requests, not the loop
                log.exception("decode_failed")
                for req in batch:
                    self._fail(req, e)
                return True
            self._advance(batch, samples, version)
        else:
            return False
        self.steps += 1
        return True

    def _advance(self, batch: list[Req], samples: list[Sample], version: str) -> None:
        for req, s in zip(batch, samples, strict=True):
            try:
                if req.seq.params.max_new_tokens == 0:  # prefilled for the prompt's log-probs only
                    req.finish_reason = finish_length(0)
                    self._cache_kv(req)
                    self.running.remove(req)
                    self._finish(req)
                    continue
                req.seq.output_ids.append(s.token)
                req.seq.logprobs.append(s.logprob)
                req.token_versions.append(version)
                if s.top is not None:
                    req.output_top.append(s.top)
                if s.ids is not None:
                    req.output_ids_lp.append(s.ids)
                if req.progress is not None:
                    req.progress.set()
                reason = self._check_finish(req, s.token)
                if reason is not None:
                    req.finish_reason = reason
                    self._cache_kv(req)
                    self.running.remove(req)
                    self._finish(req)
            except Exception as e:  # this request's fault (or its data's): fail it, not the loop
                log.exception("request_failed", rid=req.rid)
                self._fail(req, e)

    def _check_finish(self, req: Req, token: int) -> dict[str, Any] | None:
        p = req.seq.params
        out = req.seq.output_ids
        if len(out) >= p.min_new_tokens:
            # SGLang (Req._check_token_based_finish): ignore_eos turns off stop_token_ids too
            if not p.ignore_eos and (
                token in self.backend.eos_token_ids or token in (p.stop_token_ids or ())
            ):
                return finish_stop(token)
            if p.stop_strings:
                tail = self.backend.detokenize(out[-16:], p.skip_special_tokens)
                for s in p.stop_strings:
                    if s in tail:
                        return finish_stop(s)
            for pattern in p.stop_patterns:  # SGLang searches the tail the pattern can span
                tail = self.backend.detokenize(out[-_regex_tail_tokens(pattern) :], p.skip_special_tokens)
                if re.search(pattern, tail):
                    return finish_stop(pattern)
        limit = p.max_new_tokens
        assert limit is not None, "max_new_tokens is resolved before scheduling (Engine.check_length)"
        if len(out) >= limit:
            return finish_length(limit)
        return None

    def _reap_aborts(self) -> None:
        """Finish running requests marked for abort (on a step boundary)."""
        if not self._pending_aborts:
            return
        self._pending_aborts = False
        for req in [r for r in self.running if r.abort_message is not None]:
            self.running.remove(req)
            try:
                self._cache_kv(req)
            except Exception as e:  # one request's failure fails it, not the loop
                log.exception("request_failed", rid=req.rid)
                self._fail(req, e)
                continue
            req.finish_reason = finish_abort(req.abort_message or ABORT_RUNNING_MESSAGE)
            self._finish(req)
        for req in [r for r in self.waiting if r.abort_message is not None]:  # retracted, then aborted
            self.waiting.remove(req)
            req.finish_reason = finish_abort(req.abort_message or ABORT_WAITING_MESSAGE)
            self._finish(req)

    def _cache_kv(self, req: Req) -> None:
        """Hand the request's KV to the prefix cache (SGLang caches (prompt + output)[:-1])."""
        if req.seq.slot is None and not req.prefilled:
            return
        kv = self.backend.release(req.seq)
        req.prefilled = False
        ids = req.seq.ids[:-1]
        if ids and req.seq.lora is None:
            self.cache.insert(ids, kv)

    def _fail(self, req: Req, exc: Exception) -> None:
        with contextlib.suppress(ValueError):
            self.running.remove(req)
        with contextlib.suppress(Exception):  # best effort: the request has failed already
            self.backend.release(req.seq)
        self.by_rid.pop(req.rid, None)
        if not req.future.done():
            req.future.set_exception(exc)

    def _finish(self, req: Req) -> None:
        self.by_rid.pop(req.rid, None)
        self._resolve(req)

    def _resolve(self, req: Req) -> None:
        self.by_rid.pop(req.rid, None)
        if req.future.done():
            return
        try:
            result = self._result(req)
        except Exception as e:  # one request's failure fails it, not the loop
            log.exception("detokenize_failed", rid=req.rid)
            req.future.set_exception(e)
            return
        req.future.set_result(result)

    def _result(self, req: Req, partial: bool = False) -> GenerateResult:
        """The request's answer; ``partial``: its output so far, as a streamed event (no finish
        reason; SGLang sends the weight-version spans only with the last event)."""
        seq, p = req.seq, req.seq.params
        reason = None if partial else req.finish_reason
        shown = seq.output_ids
        if reason and reason["type"] == "stop" and isinstance(reason["matched"], int) and not p.no_stop_trim:
            shown = seq.output_ids[:-1]
        text = self.backend.detokenize(shown, p.skip_special_tokens)
        if reason and reason["type"] == "stop" and isinstance(reason["matched"], str):
            # SGLang's trim (trim_matched_stop): at the first occurrence of the matched string, kept
            # with no_stop_trim; a stop_regex is searched as literal text, so it rarely trims
            matched = reason["matched"]
            pos = text.find(matched)
            if pos != -1:
                text = text[: pos + len(matched)] if p.no_stop_trim else text[:pos]
        return GenerateResult(
            rid=seq.rid,
            text=text,
            output_ids=list(seq.output_ids),
            finish_reason=reason,
            prompt_tokens=len(seq.input_ids),
            cached_tokens=req.cached_tokens or 0,
            weight_version=self.weight_version,
            e2e_latency=time.monotonic() - req.created,
            logprobs=self._logprobs(req) if req.return_logprob else None,
            output_token_weight_versions=None if partial else list(req.token_versions),
            extra_meta={"num_retractions": req.retractions},
        )

    def _logprobs(self, req: Req) -> LogprobReport:
        seq = req.seq
        rep = LogprobReport(output=list(seq.logprobs))
        if seq.top_logprobs > 0:
            rep.output_top, rep.input_top = list(req.output_top), []
        if seq.token_ids_logprob is not None:
            rep.token_ids, rep.output_ids_lp, rep.input_ids_lp = (
                seq.token_ids_logprob,
                list(req.output_ids_lp),
                [],
            )
        inp = seq.input_logprobs
        if seq.logprob_start is not None and inp is not None and seq.logprob_start < len(seq.input_ids):
            # SGLang does not compute the position it starts at: None there
            rep.input_ids = seq.input_ids[seq.logprob_start :]
            rep.input = [None, *inp.lps]
            if rep.input_top is not None:
                rep.input_top = [None, *(inp.top or [])]
            if rep.input_ids_lp is not None:
                rep.input_ids_lp = [None, *(inp.ids or [])]
        if req.logprob_text:  # once per distinct token: a top-k list repeats the same ids
            rep.text = functools.cache(lambda t: self.backend.detokenize([t], skip_special_tokens=False))
        return rep

    def stats(self) -> dict[str, Any]:
        """Counters for ``/get_server_info``."""
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "paused": self.paused,
            "steps": self.steps,
            "prefill_tokens": self.prefill_tokens,
            "cache_tokens": self.cache.total_tokens,
            "cache_hit_tokens": self.cache.hits,
        }
