"""Rollout: run many episodes at once, each admitted by the governor, results to the buffer.

:class:`Rollout` is the plain core (testable with the in-process governor and buffer);
:class:`RolloutActor` serves it as an rlactors actor that builds its client, workflow and
prompt source from specs inside its own process and registers with the governor and the
buffer, which watch it: if it dies, its leases are released and its in-flight episodes
re-queued. Spawned with ``max_restarts`` it is replaceable: the restarted incarnation registers as
a new holder, starts at the governor's version, skips the groups the buffer accepted, and picks up
the re-queued episodes; :class:`RolloutHandle` lets a driver's calls survive the restart.

Order of an admission: acquire a batch of grants (one call for up to ``acquire_batch``
episodes) -> raise the client's version to the grant's (token versions are never older
than the admission version: the staleness argument needs it) -> take re-queued episodes
first, then fresh prompts -> ``begin_many`` them at the buffer, one call per grant -> run. Leases
are released by the buffer on ``put``/``abandon``; grants left unused (source exhausted, or refused
by the buffer: already trained) are returned here.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections.abc import Iterator
from typing import Any

import structlog

import rlactors
from nodes.common.trace import TRACE
from nodes.rollout.client import SGLangClient
from nodes.rollout.config import RolloutConfig
from nodes.rollout.failures import MIN_FIRST, FailureWatch, RewardTally, reward_tally
from nodes.rollout.prompts import PromptSpec, prompt_source
from nodes.rollout.workflows import Workflow, WorkflowSpec, build_workflow
from rlactors.api.handle import HandleProxy
from rlactors.base.aio import wait_for
from rlactors.base.logging import Throttle
from rlactors.wire.runtime import current_client

# What a rollout actor imports as it starts (its tokenizer's), imported once by its node's fork
# server (rlactors.node.forkserver).
FORK_PRELOAD = ("transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_fast")

__all__ = ["Rollout", "RolloutActor", "RolloutConfig", "RolloutHandle"]

log = structlog.get_logger(__name__)

STALL_WARN_S = 1.0  # a loop late by more than this to a timer is logged (throttled)


async def _aw(x: Any) -> Any:
    """Await ``x`` if it is awaitable: the core talks to plain objects and actor handles alike."""
    return await x if inspect.isawaitable(x) else x


class Rollout:
    """The dispatch loop and episode tasks of one rollout actor."""

    def __init__(
        self,
        holder_id: str,
        client: SGLangClient,
        workflow: Workflow,
        prompts: Iterator[tuple[str, Any]],
        governor: Any,
        buffer: Any,
        config: RolloutConfig | None = None,
        name: str = "",
        first_batch: int = 0,
    ) -> None:
        """``name``: the workflow's, in the line a run stops with; ``first_batch``: the episodes of
        this actor's share of the first batch (at least ``MIN_FIRST`` are judged)."""
        self.holder_id = holder_id
        self.client, self.workflow, self.prompts = client, workflow, prompts
        self.governor, self.buffer = governor, buffer
        self.config = config or RolloutConfig()
        self.name = name or f"workflow {type(workflow).__name__}"
        self.watch = FailureWatch(
            max(first_batch, MIN_FIRST), self.config.failure_window, self.config.max_failure_share
        )
        self.stop_line: str | None = None  # set when failures that repeat stop the run
        # on-policy distillation: a nodes.rollout.teacher.TeacherScorer adds the teacher's log-probs
        # to every group before it goes to the buffer (None: no teacher)
        self.teacher: Any = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._dispatch = asyncio.Event()
        self._dispatch.set()
        self._slot_freed = asyncio.Event()
        self._stopping = False
        self._exhausted = False
        self._started_at: float | None = None
        self.loop_lag_max_s = 0.0  # the longest the event loop was late to a timer while running
        self._lag_log = Throttle(log, "rollout.loop_stalled")
        self.counters = dict.fromkeys(
            (
                "acquires",
                "granted",
                "returned_grants",
                "refused_begin",
                "episodes_started",
                "episodes_done",
                "episodes_failed",
                "groups_accepted",
                "groups_not_accepted",  # a duplicate, or dropped for no signal (the buffer's stats say which)
                "trajectories",
                "generated_tokens",
            ),
            0,
        )

    # -- control -------------------------------------------------------------------

    def pause(self) -> None:
        """Stop admitting episodes and hold aborted requests: the servers are about to be updated."""
        self._dispatch.clear()
        self.client.pause()

    async def resume(self) -> None:
        """Resume dispatch and let held requests re-post at once; return once every server that
        had held requests has its first one posting again (a server still paused holds it, so
        a caller that continues the servers after this finds work waiting at each)."""
        self.client.resume()
        self._dispatch.set()
        await self.client.reposted()

    def set_version(self, version: int, servers: list[str] | None = None) -> None:
        """The servers now hold ``version``; with ``servers``, exactly those do: route to them (one
        may have joined) and to no other (a restarted actor began with the servers it was spawned
        with, some of them since dropped)."""
        self.client.set_version(version)
        if servers is not None:
            keep = [u.rstrip("/") for u in servers]
            for url in keep:
                self.client.add(url)
            for url in self.client.urls:
                if url not in keep:
                    self.client.retire(url)

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called."""
        return self._stopping

    @property
    def inflight(self) -> int:
        """Episodes running now."""
        return len(self._tasks)

    def stats(self) -> dict[str, Any]:
        """Own counters, the client's, and rates since start."""
        elapsed = time.monotonic() - self._started_at if self._started_at else 0.0
        out: dict[str, Any] = {**self.counters, **{f"client_{k}": v for k, v in self.client.counters.items()}}
        out.update({f"workflow_{k}": v for k, v in getattr(self.workflow, "counters", {}).items()})
        if self.teacher is not None:
            out.update(teacher_calls=self.teacher.calls, teacher_time_s=self.teacher.seconds)
        if judge := sys.modules.get("nodes.rollout.judge"):  # an LLM judge's counters, if one runs here
            out.update({f"reward_{k}": v for k, v in judge.COUNTERS.items()})
        out.update(
            inflight=len(self._tasks),
            paused=not self._dispatch.is_set(),
            version=self.client.version,
            exhausted=self._exhausted,
            elapsed_s=elapsed,
            episodes_per_s=self.counters["episodes_done"] / elapsed if elapsed else 0.0,
            tokens_per_s=self.counters["generated_tokens"] / elapsed if elapsed else 0.0,
            resume_reposts=[list(r) for r in self.client.reposts],
            waiting=self.client.waiting(),
            loop_lag_max_s=self.loop_lag_max_s,
        )
        return out

    # -- the loop ------------------------------------------------------------------

    async def run(self) -> None:
        """Dispatch until the prompt source is exhausted or :meth:`stop`; then wait for running episodes."""
        self._started_at = time.monotonic()
        lag = asyncio.get_running_loop().create_task(self._watch_lag(), name="rollout-loop-lag")
        try:
            while not self._stopping and not self._exhausted and self.stop_line is None:
                if not self._dispatch.is_set():
                    await self._dispatch.wait()
                    continue
                free = self.config.max_inflight - len(self._tasks)
                if free <= 0:
                    self._slot_freed.clear()
                    await self._slot_freed.wait()
                    continue
                await self._admit(min(free, self.config.acquire_batch))
            if self._tasks and not self._stopping:
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        except asyncio.CancelledError:  # cancelled from outside: stop as stop() would, episodes too
            self._stopping = True
            raise
        finally:
            lag.cancel()
            if self._stopping:
                await self._cancel_all()

    async def _watch_lag(self, period_s: float = 0.1) -> None:
        """Record how late the loop runs a timer: a loop turn longer than the client's connect
        timeout makes that timeout fire on connects that had completed (a spurious retry)."""
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(period_s)
            lag = loop.time() - t - period_s
            self.loop_lag_max_s = max(self.loop_lag_max_s, lag)
            if lag > STALL_WARN_S:
                self._lag_log(lag_s=round(lag, 2), connect_timeout_s=self.client.config.connect_timeout_s)

    async def stop(self) -> None:
        """Stop dispatching and cancel running episodes (their leases go back through the buffer)."""
        self._stopping = True
        self._dispatch.set()
        self._slot_freed.set()
        await self._cancel_all()

    async def _admit(self, want: int) -> None:
        self.counters["acquires"] += 1
        grant = await _aw(self.governor.acquire(self.holder_id, want, self.config.acquire_timeout_s))
        if not grant.n:
            return
        self.counters["granted"] += grant.n
        if self._stopping:  # stop() came while we waited for the grant
            await self._return_grants(grant.n)
            return
        self.client.set_version(grant.version)  # token versions must not predate the admission
        settled = 0  # settled: grants turned into episodes, or released by the buffer
        picked: list[tuple[str, Any]] = []
        began: list[bool] = []  # the buffer's answer, one per picked prompt; empty if it never came
        try:
            work = list(await _aw(self.buffer.take_requeued(grant.n, self.holder_id, grant.version)))
            for w in work:  # already in flight for us at the buffer
                settled += 1
                if self._stopping:
                    await self._abandon(w["group_id"])  # gives its lease back through the buffer
                else:
                    self._start(w["group_id"], w["item"])
            if settled < grant.n and not self._stopping:
                picked = self._next_prompts(grant.n - settled)
                # one call for the grant: with the buffer an actor, a round trip per episode would
                # hold the episodes in flight to one per round trip
                began = list(await _aw(self.buffer.begin_many(self.holder_id, picked, grant.version)))
        finally:
            if picked:  # also when the call failed or was cancelled: then each is settled as unanswered
                settled += await self._settle_begins(picked, began)
            if settled < grant.n:  # exhausted, stopping, or the buffer failed us: give the rest back
                await self._return_grants(grant.n - settled)

    def _next_prompts(self, n: int) -> list[tuple[str, Any]]:
        """Up to ``n`` fresh prompts, in source order, none of them running already."""
        picked: dict[str, Any] = {}
        skipped = 0
        while len(picked) < n:
            nxt = next(self.prompts, None)
            if nxt is None:
                self._exhausted = True
                break
            gid, item = nxt
            if gid in self._tasks or gid in picked:  # a source repeating a running id: skip it, not for ever
                skipped += 1
                if skipped >= n:
                    break
                continue
            picked[gid] = item
        return list(picked.items())

    async def _settle_begins(self, picked: list[tuple[str, Any]], began: list[bool]) -> int:
        """Start the episodes begun; how many grants the buffer now holds (it releases them). A
        refused one (already trained) is the caller's to return. Without an answer (``began`` empty:
        the call failed or was cancelled, perhaps after the buffer recorded them) nothing starts and
        each is abandoned: the abandon settles what the buffer had; if stop() came, the begun ones
        are abandoned too."""
        if not began:
            found = await asyncio.shield(asyncio.gather(*(self._abandon(gid) for gid, _ in picked)))
            return sum(found)
        settled, drop = 0, []
        for (gid, item), ok in zip(picked, began, strict=True):
            if not ok:  # already trained (a replayed source): its grant goes back from us
                self.counters["refused_begin"] += 1
                continue
            settled += 1  # the buffer holds the lease: a put or an abandon gives it back
            if self._stopping:
                drop.append(gid)
            else:
                self._start(gid, item)
        if drop:
            await asyncio.shield(asyncio.gather(*(self._abandon(gid) for gid in drop)))
        return settled

    def _start(self, gid: str, item: Any) -> None:
        self.counters["episodes_started"] += 1
        self._tasks[gid] = asyncio.get_running_loop().create_task(
            self._episode(gid, item), name=f"episode-{gid}"
        )

    async def _return_grants(self, n: int) -> None:
        self.counters["returned_grants"] += n
        await _aw(self.governor.finish(self.holder_id, 0, n))

    async def _episode(self, gid: str, item: Any) -> None:
        started = time.time()
        rewards = RewardTally()
        reward_tally.set(rewards)  # this task's context: its reward calls count here
        try:
            try:
                group = await self.workflow.arun_episode(self.client, item, gid)
                if self.teacher is not None:  # its calls overlap the other episodes' generation
                    await self.teacher.score(group)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a workflow's failure fails its episode, counted
                self.counters["episodes_failed"] += 1
                await self._judge(self.watch.failure(self.name, e, item, gid))
                await self._abandon(gid)
                return
            if rewards.calls and rewards.errors == rewards.calls and rewards.first is not None:
                # every sample's reward raised: its zeros are no signal to train on
                self.counters["episodes_failed"] += 1
                await self._judge(
                    self.watch.failure(f"reward function {rewards.name}", rewards.first, item, gid)
                )
                await self._abandon(gid)
                return
            self.watch.ok()
            try:
                await self._put(gid, group)
            except Exception as e:  # the put did not land (or its answer was lost): settle the lease
                self.counters["episodes_failed"] += 1
                log.error("rollout.put_failed", group=gid, error=f"{type(e).__name__}: {e}")
                await self._abandon(gid)  # a no-op if it did land
        except asyncio.CancelledError:
            await asyncio.shield(self._abandon(gid))  # a no-op if the put already landed
            raise
        finally:
            self._tasks.pop(gid, None)
            self._slot_freed.set()
            TRACE.async_span("episode", f"{gid}#{started}", started, time.time(), TRACE.track, group=gid)

    async def _judge(self, line: str | None) -> None:
        """Failures that repeat stop the run: dispatch ends, and the buffer's ``get_batch`` raises
        :class:`~nodes.plane.buffer.RepeatedFailureError` with ``line`` (once)."""
        if line is None or self.stop_line is not None:
            return
        self.stop_line = line
        self._slot_freed.set()
        log.error("rollout.repeated_failure", error=line)
        try:
            await _aw(self.buffer.fail(line))
        except Exception as e:  # the buffer gone: the run is ending anyway
            log.error("rollout.repeated_failure_not_delivered", error=repr(e))

    async def _put(self, gid: str, group: Any) -> None:
        for attempt in range(self.config.put_retries + 1):
            try:
                accepted = await _aw(self.buffer.put(self.holder_id, group))
                break
            except rlactors.ActorDiedError:
                raise
            except Exception as e:  # retried: the put's failure is only known after the last try
                if attempt == self.config.put_retries:
                    raise
                log.warning("rollout.put_retry", group=gid, error=repr(e))
                await asyncio.sleep(0.05 * 2**attempt)
        self.counters["episodes_done"] += 1
        self.counters["groups_accepted" if accepted else "groups_not_accepted"] += 1
        self.counters["trajectories"] += len(group.trajectories)
        self.counters["generated_tokens"] += sum(t.num_generated for t in group.trajectories)

    async def _abandon(self, gid: str) -> bool:
        """Give the episode's lease back through the buffer (an episode left in flight there would
        hold back every batch admitted after it). True if the buffer had it in flight."""
        for attempt in range(self.config.put_retries + 1):
            try:
                return bool(await _aw(self.buffer.abandon(self.holder_id, gid)))
            except rlactors.ActorDiedError as e:  # the buffer is gone: nothing left to settle
                log.warning("rollout.abandon_failed", group=gid, error=repr(e))
                return False
            except Exception as e:  # retried: logged after the last try
                if attempt == self.config.put_retries:
                    log.error("rollout.abandon_failed", group=gid, error=repr(e))
                    return False
                await asyncio.sleep(0.05 * 2**attempt)
        return False

    async def _cancel_all(self) -> None:
        tasks = dict(self._tasks)
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        # A task cancelled before its first step never ran its body, so neither its abandon nor
        # its finally: its lease would stay in flight at the buffer and hold back every batch.
        never_ran = [gid for gid in tasks if gid in self._tasks]
        for gid in never_ran:
            del self._tasks[gid]
        await asyncio.gather(*(self._abandon(gid) for gid in never_ran))


class RolloutActor(Rollout, rlactors.Actor, sync_methods="loop"):
    """A rollout actor: builds its client, workflow and prompt shard in-process, then runs.

    ``governor`` and ``buffer`` are handles or actor names. ``prompts`` is a spec (see
    nodes/rollout/prompts.py), ``workflow`` a :class:`WorkflowSpec`, ``config`` the
    :class:`~nodes.rollout.config.RolloutConfig` (its dispatch settings and ``client``). Its methods are
    :class:`Rollout`'s (pause, resume, set_version, stop, ...), run on the actor's loop, and
    what this class adds.
    """

    def __init__(
        self,
        servers: list[str],
        governor: Any,
        buffer: Any,
        prompts: PromptSpec | dict[str, Any],
        workflow: WorkflowSpec,
        config: RolloutConfig | None = None,
        shard: int = 0,
        num_shards: int = 1,
        version: int = 0,
        autostart: bool = True,
        first_batch: int = 0,
        teacher: str = "",
    ) -> None:
        """``teacher``: on-policy distillation's teacher model (its pool actor ``inference-pool-<teacher>``)."""
        self._args = dict(
            servers=servers,
            governor=governor,
            buffer=buffer,
            prompts=prompts,
            workflow=workflow,
            config=config or RolloutConfig(),
            shard=shard,
            num_shards=num_shards,
            version=version,
            first_batch=first_batch,
            teacher=teacher,
        )
        self._autostart = autostart
        self._run: asyncio.Task | None = None
        self.failure: str | None = None

    async def on_start(self) -> None:
        # The Rollout is initialised here, not in __init__: its parts come from the cluster.
        a = self._args
        ctx = rlactors.get_context()
        governor, buffer = a["governor"], a["buffer"]
        if isinstance(governor, str):
            governor = await ctx.cluster.get_actor(governor)
        if isinstance(buffer, str):
            buffer = await ctx.cluster.get_actor(buffer)
        holder_id = f"{ctx.actor_id}:{ctx.restarts}"  # a restarted incarnation is a new holder
        TRACE.track = ctx.name or holder_id
        await governor.register(holder_id, ctx.actor_id)
        await buffer.register(holder_id, ctx.actor_id)
        # A restart re-runs this with the spawn's arguments: take the version the servers hold now
        # from the governor, and skip what the buffer accepted (its shard starts again from the top;
        # the episodes the dead incarnation held come back through the buffer's re-queue).
        version = max(a["version"], (await governor.stats())["version"])
        accepted = await buffer.accepted_ids()
        workflow = await asyncio.to_thread(build_workflow, a["workflow"])  # may load a tokenizer
        client = SGLangClient(a["servers"], a["config"].client, version=version)
        prompts = prompt_source(a["prompts"], a["shard"], a["num_shards"], skip=accepted)
        name = f"workflow {a['workflow'].workflow}"
        super().__init__(
            holder_id, client, workflow, prompts, governor, buffer, a["config"], name, a["first_batch"]
        )
        if a["teacher"]:
            from nodes.rollout.models import ModelClient
            from nodes.rollout.teacher import TeacherScorer

            pool = await ctx.cluster.get_actor(f"inference-pool-{a['teacher']}")
            self.teacher = TeacherScorer(ModelClient(a["teacher"], pool, a["config"].client))
        if self._autostart:
            self.start()

    def start(self) -> None:
        """Start dispatching (once)."""
        if self._run is None:
            self._run = asyncio.get_running_loop().create_task(self.run(), name="rollout-run")
            self._run.add_done_callback(self._run_ended)

    def _run_ended(self, task: asyncio.Task) -> None:
        """Dispatch must not die silently: the trainer would only see batches stop coming."""
        if not task.cancelled() and task.exception() is not None:
            self.failure = f"{type(task.exception()).__name__}: {task.exception()}"
            if self.stopping:  # e.g. the cluster closing under a stopped actor
                log.info("rollout.dispatch_ended_while_stopping", error=self.failure)
                return
            log.error("rollout.dispatch_failed", error=self.failure)

    def drain_trace(self) -> list[dict[str, Any]]:
        """This process's timeline events since the last call (nodes/common/trace.py); recording starts
        with the first call."""
        return TRACE.drain()

    def retire_server(self, url: str) -> bool:
        """Stop routing to a server that is gone."""
        return self.client.retire(url)

    def stats(self) -> dict[str, Any]:
        """Counters of this incarnation: throughput, aborts, resumes, cached tokens, ...; ``restarts``
        (how many incarnations came before it), ``failure`` if dispatch died, ``stop_line`` if
        failures that repeat stopped it."""
        return {
            **super().stats(),
            "restarts": rlactors.get_context().restarts,
            "failure": self.failure,
            "stop_line": self.stop_line,
        }

    async def wait_done(self, timeout: float = 600.0) -> dict[str, Any]:
        """Wait until the prompt source is exhausted and every episode finished; the final stats."""
        if self._run is not None:
            await wait_for(asyncio.shield(self._run), timeout)
        return self.stats()

    async def on_stop(self) -> None:
        await self.stop()
        await self.client.aclose()
        if getattr(self, "teacher", None) is not None:  # on_start may have failed before setting it
            await self.teacher.client.aclose()


class RolloutHandle(HandleProxy[RolloutActor]):
    """A driver's handle to a rollout actor spawned with ``max_restarts``: ``await r.stats()``, typed
    from :class:`RolloutActor`'s methods by the mypy plugin (:class:`rlactors.api.handle.HandleProxy`).

    A call that the actor's death interrupted is made again, and reaches the restarted
    incarnation (a call made while it restarts waits for it); once its restarts are spent, a call
    raises :class:`rlactors.ActorDiedError` as a plain handle's does. A call that finds the actor
    unreachable (hung, or cut off) waits until it answers again or its node agent has replaced it
    (after the runtime's ``fence_after``), then is made again; that spends no restart. Only for
    a replaceable actor whose methods may be repeated: every public method of
    :class:`RolloutActor` may.
    """

    UNREACHABLE_WAIT_S = 600.0  # how long an unreachable actor may take to answer or be replaced

    def __init__(self, handle: rlactors.ActorHandle[RolloutActor], max_restarts: int) -> None:
        self.handle, self.max_restarts = handle, max_restarts

    async def _call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        deaths = 0
        while True:
            try:
                return await getattr(self.handle, method)(*args, **kwargs)
            except rlactors.ActorUnreachableError as e:
                log.warning("rollout.call_unreachable_waiting", method=method, error=str(e))
                try:
                    await current_client().wait_reachable(self.handle.actor_id, self.UNREACHABLE_WAIT_S)
                except TimeoutError:
                    raise e from None
            except rlactors.ActorDiedError as e:  # each death that interrupts a call spends a restart
                deaths += 1
                if deaths > self.max_restarts:  # dead for good
                    raise
                log.warning("rollout.call_died_retrying", method=method, error=str(e))
