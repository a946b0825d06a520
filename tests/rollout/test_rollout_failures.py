"""Failure paths of the rollout plane: a failed put, a failing buffer, stop() during an acquire,
a failing sample, resumes with min_new_tokens, failover back to a recovered server, templates
that rewrite the answer, rids that SGLang's prefix abort could confuse."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from structlog.testing import capture_logs

from nodes.plane.buffer import BufferConfig, TrajectoryBuffer
from nodes.plane.governor import GovernorConfig, StalenessGovernor
from nodes.rollout.actor import Rollout
from nodes.rollout.client import ClientConfig, GenerationError, GenRequest, SGLangClient
from nodes.rollout.config import RolloutConfig
from nodes.rollout.prompts import prompt_source
from nodes.rollout.workflows import (
    ByteChatTokenizer,
    MultiTurnConfig,
    MultiTurnWorkflow,
    RLVRConfig,
    RLVRWorkflow,
    new_attempt,
    sample_rid,
)
from protocols.rl import Trajectory, TrajectoryGroup
from rlactors.base.aio import wait_for
from tests.rollout.scripted import Answer, Posted, Serve, answer, reply


class Watched:
    """Something a test waits on without polling: :meth:`until` re-checks on every :meth:`note`."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()

    def note(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def until(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:
        async def wait() -> None:
            while not condition():
                await self._changed.wait()

        await wait_for(wait(), timeout)  # generous: the machine may be loaded


class FakeWorkflow(Watched):
    """One trajectory per episode after ``delay`` seconds; records what it started."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.delay, self.started = delay, []

    async def arun_episode(self, client: Any, item: Any, group_id: str | None = None) -> TrajectoryGroup:
        self.started.append(group_id)
        self.note()
        await asyncio.sleep(self.delay)
        v = client.version
        return TrajectoryGroup(
            group_id, [Trajectory([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.1], [-1, v, v], 1.0, group_id, 1, {})]
        )


def make(
    n: int, B: int = 2, eta: int = 1, C: int = 64, wf: Any = None, buf_cls: Any = TrajectoryBuffer, **cfg
):
    gov = StalenessGovernor(GovernorConfig(B, eta, max_concurrent=C))
    buf = buf_cls(BufferConfig(max_staleness=eta), governor=gov)
    prompts = iter([(f"p/{i}", {"q": i}) for i in range(n)])
    return (
        gov,
        buf,
        Rollout(
            "h0",
            SGLangClient(["http://unused:1"]),
            wf or FakeWorkflow(),
            prompts,
            gov,
            buf,
            RolloutConfig(**cfg),
        ),
    )


async def test_stop_during_an_acquire_starts_nothing_more() -> None:
    wf = FakeWorkflow(delay=1.0)
    gov, buf, r = make(10, B=1, eta=0, C=1, wf=wf, max_inflight=4, acquire_batch=4, acquire_timeout_s=5)
    run = asyncio.create_task(r.run())
    await asyncio.sleep(0.2)  # p/0 starts; then dispatch waits in acquire (capacity 0)
    assert wf.started == ["p/0"]
    await r.stop()  # p/0 is cancelled; dispatch is waiting in acquire (capacity 0)
    gov.set_version(1)  # capacity opens while that acquire still waits
    await wait_for(run, 2)
    assert wf.started == ["p/0"]
    assert gov.running == 0 and gov.leases("h0") == 0 and buf.in_flight == 0


class FlakyPutBuffer(TrajectoryBuffer):
    def put(self, holder_id: str, group: TrajectoryGroup, admit_version: int | None = None) -> bool:
        if group.group_id == "p/0":
            raise ConnectionError("buffer unreachable (transient)")
        return super().put(holder_id, group, admit_version)


async def test_a_put_that_keeps_failing_releases_its_lease_and_training_goes_on() -> None:
    gov, buf, r = make(
        12, wf=FakeWorkflow(0.01), buf_cls=FlakyPutBuffer, put_retries=1, max_inflight=2, acquire_batch=2
    )
    run = asyncio.create_task(r.run())
    for v in range(5):  # 11 groups can be put: five batches of 2, none held back by p/0
        batch = await buf.get_batch(2, v, timeout=10)
        assert "p/0" not in [g.group_id for g in batch.groups]
        gov.set_version(v + 1)
        r.set_version(v + 1)
    await r.stop()
    await wait_for(run, 5)
    assert r.stats()["episodes_failed"] == 1 and buf.stats()["abandoned"] == 1
    assert gov.leases("h0") == 0 and buf.in_flight == 0


class FlakyBeginBuffer(TrajectoryBuffer):
    fail = True

    def begin_many(self, holder_id: str, episodes: Any, admit_version: int) -> list[bool]:
        if self.fail:
            self.fail = False
            raise ConnectionError("buffer call timed out")
        return super().begin_many(holder_id, episodes, admit_version)


async def test_grants_go_back_when_the_buffer_fails_a_begin() -> None:
    gov, _, r = make(4, B=4, wf=FakeWorkflow(0.0), buf_cls=FlakyBeginBuffer, acquire_batch=4)
    with pytest.raises(ConnectionError):
        await r.run()
    assert gov.leases("h0") == 0 and gov.running == 0


def test_requeued_episodes_are_begun_in_the_same_call() -> None:
    gov = StalenessGovernor(GovernorConfig(2, 1, max_concurrent=10))
    buf = TrajectoryBuffer(BufferConfig(max_staleness=1), governor=gov)
    assert gov.try_acquire("dead", 2).n == 2
    buf.begin("dead", "g/a", {"q": 1}, 0)
    buf.begin("dead", "g/b", {"q": 2}, 0)
    gov.holder_died("dead")
    buf.holder_died("dead")
    assert gov.try_acquire("h0", 2).n == 2
    assert [w["group_id"] for w in buf.take_requeued(2, "h0", 1)] == ["g/a", "g/b"]
    assert buf.in_flight == 2 and buf.stats()["requeue_pending"] == 0
    t = Trajectory([1, 2], [0, 1], [0.0, -0.1], [-1, 1], 1.0, "g/a", 1)
    assert buf.put("h0", TrajectoryGroup("g/a", [t]))  # accepted from the new holder


async def test_a_failing_sample_cancels_its_siblings(serve: Serve) -> None:
    done_after_failure = []

    async def handler(req: Posted) -> Answer:
        if req.json()["rid"].endswith("/s0/"):
            return answer(400, json={"error": "bad request"})
        await asyncio.sleep(0.3)
        done_after_failure.append(1)
        return reply([1, 2], "length")

    [A] = (await serve(handler, "a")).urls
    client = SGLangClient([A], ClientConfig())
    wf = RLVRWorkflow(ByteChatTokenizer(), lambda c, i: 0.0, RLVRConfig(n_samples=4))
    with pytest.raises(GenerationError):
        await wf.arun_episode(client, {"question": "q", "answer": "1"}, "g")
    await asyncio.sleep(0.5)
    assert done_after_failure == [] and client.load() == {A: 0}  # nothing kept generating
    await client.aclose()


async def test_a_resume_lowers_min_new_tokens_too(serve: Serve) -> None:
    seen: list[dict] = []

    def handler(req: Posted) -> Answer:
        sp = req.json()["sampling_params"]
        seen.append(sp)
        if len(seen) == 1:
            return reply([5, 6, 7, 8, 9, 10], "abort", message="paused")
        if sp.get("min_new_tokens", 0) > sp["max_new_tokens"]:  # SGLang's SamplingParams.verify
            return answer(400, json={"error": "min_new_tokens must be in [0, max_new_tokens]"})
        return reply([1] * sp["max_new_tokens"], "length")

    [A] = (await serve(handler, "a")).urls
    client = SGLangClient([A], ClientConfig())
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 10, "min_new_tokens": 8}, rid="m"))
    assert len(res.output_ids) == 10
    assert seen[1]["max_new_tokens"] == 4 and seen[1]["min_new_tokens"] == 2
    await client.aclose()


async def test_a_request_fails_over_back_to_a_server_that_recovered(serve: Serve) -> None:
    cfg = ClientConfig(backoff_base_s=0.001, backoff_max_s=0.002, max_retries=0, down_cooldown_s=0.05)
    state = {"a_down": True, "b_posts": 0}

    async def handler(req: Posted) -> Answer:
        if req.host == "a":
            return answer(503, text="restarting") if state["a_down"] else reply([9], "length")
        state["b_posts"] += 1
        if state["b_posts"] == 1:
            state["a_down"] = False  # A comes back while B serves the first chunk
            await asyncio.sleep(0.1)  # longer than A's cool-down
            return reply([5, 6], "abort", message="paused")
        return answer(503, text="restarting")

    A, B = (await serve(handler, "a", "b")).urls
    client = SGLangClient([A, B], cfg)
    client._servers[B].inflight = 5  # start on A
    res = await client.agenerate(GenRequest([1, 2], {"max_new_tokens": 3}, rid="r"))
    assert res.output_ids == [5, 6, 9]
    await client.aclose()


def test_sample_rids_are_never_prefixes_of_each_other() -> None:
    rids = [
        sample_rid(g, i, attempt)
        for g in ("gsm8k/e0/1", "gsm8k/e0/10", "gsm8k/e0/1/s")
        for i in (*range(12), 100, 1000, 10000)
        for attempt in ("a1", "a10", "b")
    ]
    assert not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]
    # every run of an episode has its own rids: a re-run never meets its earlier run's requests
    assert sample_rid("g", 0, new_attempt()) != sample_rid("g", 0, new_attempt())
    assert all(r.startswith("gsm8k/") for r in rids)  # the group's prefix still aborts them all


def test_an_empty_shard_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="empty"):
        prompt_source({"kind": "items", "items": [{"q": 1}], "epochs": None}, shard=1, num_shards=2)


class TrimmingTokenizer(ByteChatTokenizer):
    """A chat template that trims every message, as Llama 3's does."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kw):
        trimmed = [{**m, "content": m["content"].strip()} for m in messages]
        return super().apply_chat_template(
            trimmed, tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kw
        )


async def test_multi_turn_feedback_with_a_template_that_trims_the_answer(serve: Serve) -> None:
    tok = TrimmingTokenizer()
    answers = iter([" 5 ", "\\boxed{4}"])

    async def handler(req: Posted) -> Answer:
        return reply(list(tok.encode(next(answers), add_special_tokens=False)), "length")

    [A] = (await serve(handler, "a")).urls
    client = SGLangClient([A], ClientConfig())
    wf = MultiTurnWorkflow(
        tok, lambda c, i: float("\\boxed{4}" in c), MultiTurnConfig(n_samples=1, max_turns=2)
    )
    [t] = (await wf.arun_episode(client, {"question": "what is 2+2?", "answer": "4"}, "g")).trajectories
    full = tok.decode(t.input_ids, skip_special_tokens=False)
    assert full.count("what is 2+2?") == 1  # the feedback turn does not repeat the conversation
    assert t.reward == pytest.approx(0.9) and t.meta["turns"] == 2  # right at the second turn
    await client.aclose()


async def test_unlabelled_tokens_from_a_server_that_missed_a_push_carry_its_version(serve: Serve) -> None:
    def handler(req: Posted) -> Answer:
        r = reply([1, 2, 3], "length")
        data = json.loads(r.body)
        data["meta_info"].pop("weight_versions", None)  # as SGLang before 0.5.23 answers
        data["meta_info"]["weight_version"] = "3"  # restarted with version 3 while the others hold 5
        return answer(200, json=data)

    [A] = (await serve(handler, "a")).urls
    client = SGLangClient([A], ClientConfig(), version=5)
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": None}, rid="v"))
    assert res.output_versions == [3, 3, 3]  # staleness is never under-reported
    await client.aclose()


async def test_a_non_json_answer_names_the_server(serve: Serve) -> None:
    [A] = (await serve(lambda r: answer(200, text="<html>"), "a")).urls
    client = SGLangClient([A], ClientConfig())
    with pytest.raises(GenerationError, match=f"{A}/generate answered 200 with a non-JSON body"):
        await client.agenerate(GenRequest([1], {"max_new_tokens": 4}, rid="j"))
    await client.aclose()


class AsyncBuffer(Watched):
    """A buffer behind an actor-like async interface: begins take a while (or wait for ``gate``),
    one answer can be lost. ``begins_waiting`` and its peak count the begins on the wire."""

    def __init__(
        self,
        core: TrajectoryBuffer,
        begin_delay: float = 0.0,
        lose_answer_of: str | None = None,
        gate: asyncio.Event | None = None,
        fail_begin_of: str | None = None,
    ):
        super().__init__()
        self.core, self.begin_delay, self.lose, self.gate = core, begin_delay, lose_answer_of, gate
        self.fail = fail_begin_of
        self.begins_waiting = self.peak_begins_waiting = self.begin_calls = 0

    async def begin_many(self, h, episodes, v):
        n = len(episodes)
        self.begin_calls += 1
        self.begins_waiting += n
        self.peak_begins_waiting = max(self.peak_begins_waiting, self.begins_waiting)
        self.note()
        try:
            await asyncio.sleep(self.begin_delay)
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.begins_waiting -= n
        gids = [g for g, _ in episodes]
        if self.fail in gids:
            raise ConnectionError("buffer unreachable (the begins never landed)")
        ok = self.core.begin_many(h, episodes, v)
        if self.lose in gids:
            raise TimeoutError("buffer call timed out (the begins landed, the answer was lost)")
        return ok

    async def take_requeued(self, n, h=None, v=None):
        return self.core.take_requeued(n, h, v)

    async def put(self, h, group):
        return self.core.put(h, group)

    async def abandon(self, h, g):
        return self.core.abandon(h, g)


def make_async(n: int, wf: Any, wrap: Any, B: int = 8, **cfg):
    gov = StalenessGovernor(GovernorConfig(B, 1, max_concurrent=64))
    core = TrajectoryBuffer(BufferConfig(max_staleness=1), governor=gov)
    prompts = iter([(f"p/{i}", {"q": i}) for i in range(n)])
    return (
        gov,
        core,
        Rollout("h0", SGLangClient(["http://unused:1"]), wf, prompts, gov, wrap(core), RolloutConfig(**cfg)),
    )


async def test_stop_during_the_begins_starts_nothing() -> None:
    wf = FakeWorkflow(delay=3.0)
    gate = asyncio.Event()
    gov, core, r = make_async(4, wf, lambda c: AsyncBuffer(c, gate=gate), max_inflight=4, acquire_batch=4)
    run = asyncio.create_task(r.run())
    await r.buffer.until(lambda: r.buffer.begins_waiting == 4)  # the grant's begins are all on the wire
    await r.stop()
    gate.set()  # they land after the stop
    await wait_for(run, 5)
    assert wf.started == []
    assert gov.running == 0 and core.in_flight == 0 and gov.stats()["over_finish"] == 0


async def test_a_grant_is_begun_in_one_call() -> None:
    """Issue 14: with the buffer an actor each begin is a round trip; begun one at a time, episodes
    in flight stayed far below the configured concurrency. A grant's episodes are begun in one call,
    and all start after one round trip."""
    wf = FakeWorkflow(delay=30.0)
    gov, core, r = make_async(
        64, wf, lambda c: AsyncBuffer(c, begin_delay=0.05), B=16, max_inflight=32, acquire_batch=16
    )
    run = asyncio.create_task(r.run())
    await wf.until(lambda: len(wf.started) == 32)  # two grants of 16
    assert r.buffer.begin_calls == 2 and r.buffer.peak_begins_waiting == 16  # one at a time: 32 calls, 1
    assert wf.started == [f"p/{i}" for i in range(32)]  # prompts still taken in source order
    assert gov.leases("h0") == core.in_flight == 32
    await r.stop()
    await wait_for(run, 5)
    assert gov.running == 0 and core.in_flight == 0 and gov.stats()["over_finish"] == 0


async def test_stop_in_the_turn_episodes_start_gives_their_leases_back() -> None:
    """A task cancelled before its first step never runs its body (nor its abandon): stop() must
    still settle it, or its lease stays in flight at the buffer and holds back every batch."""
    wf = FakeWorkflow(delay=5.0)
    gov, buf, r = make(4, B=4, wf=wf)
    assert gov.try_acquire("h0", 2).n == 2
    assert buf.begin("h0", "p/0", {"q": 0}, 0) and buf.begin("h0", "p/1", {"q": 1}, 0)
    r._start("p/0", {"q": 0})
    r._start("p/1", {"q": 1})
    await r.stop()  # in the same turn: neither episode ran a step
    assert wf.started == []
    assert buf.in_flight == 0 and gov.running == 0 and r.inflight == 0 and buf.stats()["abandoned"] == 2


def _one_grant(**buf: Any) -> tuple[StalenessGovernor, TrajectoryBuffer, Rollout, FakeWorkflow]:
    """A grant of 6 (p/0..p/5) of which p/1 was trained already."""
    gov = StalenessGovernor(GovernorConfig(8, 1, max_concurrent=64))
    core = TrajectoryBuffer(BufferConfig(max_staleness=1), governor=gov, done_ids=["p/1"])
    wf = FakeWorkflow()
    prompts = iter([(f"p/{i}", {"q": i}) for i in range(8)])
    client = SGLangClient(["http://unused:1"])
    return (
        gov,
        core,
        Rollout("h0", client, wf, prompts, gov, AsyncBuffer(core, **buf), RolloutConfig(acquire_batch=6)),
        wf,
    )


async def test_a_begin_call_that_never_landed_returns_the_whole_grant() -> None:
    gov, core, r, wf = _one_grant(fail_begin_of="p/2")
    with pytest.raises(ConnectionError):
        await r.run()
    assert wf.started == [] and core.in_flight == 0 and core.stats()["abandoned"] == 0
    assert r.counters["returned_grants"] == 6
    assert gov.running == 0 and gov.leases("h0") == 0 and gov.stats()["over_finish"] == 0


async def test_a_begin_call_whose_answer_was_lost_settles_every_grant_once() -> None:
    """The begins landed (p/1 refused: trained already) but the answer was lost: nothing of the grant
    starts; the five the buffer recorded are abandoned (it releases them), and only p/1's grant comes
    back from us (the buffer left a refused one's lease with the caller, so it is not released twice)."""
    gov, core, r, wf = _one_grant(lose_answer_of="p/4")
    with pytest.raises(TimeoutError):
        await r.run()
    assert wf.started == [] and core.in_flight == 0
    assert core.stats()["abandoned"] == 5 and core.stats()["refused_begin"] == 1
    assert r.counters["returned_grants"] == 1  # p/1's
    assert gov.running == 0 and gov.leases("h0") == 0 and gov.stats()["over_finish"] == 0


async def test_a_refused_begin_gives_its_grant_back_from_the_rollout() -> None:
    gov, core, r, wf = _one_grant()
    run = asyncio.create_task(r.run())
    await wf.until(lambda: len(wf.started) == 5)
    assert "p/1" not in wf.started and r.counters["refused_begin"] == 1 and r.counters["returned_grants"] >= 1
    await r.stop()
    await wait_for(run, 5)
    assert gov.running == 0 and core.in_flight == 0 and gov.stats()["over_finish"] == 0


async def test_a_requeued_group_the_holder_already_runs_is_not_begun_twice() -> None:
    wf = FakeWorkflow(delay=2.0)
    gov, core, r = make_async(10, wf, lambda c: c, B=2, max_inflight=8, acquire_batch=2, acquire_timeout_s=5)
    assert gov.try_acquire("old", 2).n == 2
    core.begin("old", "p/9", {"q": 9}, 0)
    core.begin("old", "p/0", {"q": 0}, 0)
    run = asyncio.create_task(r.run())
    await asyncio.sleep(0.05)  # the new holder replayed p/0, p/1; its next acquire waits
    core.holder_died("old")  # requeues p/9 and p/0
    gov.holder_died("old")
    await asyncio.sleep(0.3)
    assert not run.done()  # dispatch goes on
    # p/9 re-run, p/0 not begun twice (its grant went to the next fresh prompt, p/2)
    assert sorted(core._in_flight) == [("h0", "p/0"), ("h0", "p/1"), ("h0", "p/2"), ("h0", "p/9")]
    assert gov.leases("h0") == core.in_flight
    await r.stop()
    await wait_for(run, 2)


async def test_max_new_tokens_zero_is_kept(serve: Serve) -> None:
    seen: list[dict] = []

    def handler(req: Posted) -> Answer:
        seen.append(req.json()["sampling_params"])
        return reply([], "length")

    [A] = (await serve(handler, "a")).urls
    client = SGLangClient([A], ClientConfig())
    await client.agenerate(GenRequest([1], {"max_new_tokens": 0}, rid="z"))
    assert seen[0]["max_new_tokens"] == 0
    await client.aclose()


def test_trained_position_names_an_id_it_cannot_read() -> None:
    from nodes.rollout.prompts import trained_position

    with pytest.raises(ValueError, match="'eval/v3/5'"):
        trained_position(["gsm8k/e0/0", "eval/v3/5"], 2)


def test_an_epoch_with_a_dropped_group_is_behind_once_training_is_two_epochs_on() -> None:
    from nodes.rollout.prompts import trained_position

    ids = [f"d/e0/{i}" for i in (0, 1, 2)] + ["d/e1/0"]  # d/e0/3 was dropped as stale
    assert trained_position(ids, 4) == {"done_epochs": 0, "trained": sorted(ids)}
    assert trained_position([*ids, "d/e2/1"], 4) == {"done_epochs": 1, "trained": ["d/e1/0", "d/e2/1"]}


async def test_the_rollout_records_and_logs_a_stalled_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop turn longer than the client's connect timeout times out connects that completed: the
    rollout reports the longest stall in its stats and logs stalls past STALL_WARN_S."""
    import time

    import nodes.rollout.actor as actor

    monkeypatch.setattr(actor, "STALL_WARN_S", 0.2)
    _, _, r = make(4, B=4, wf=FakeWorkflow(delay=5.0))
    run = asyncio.create_task(r.run())
    with capture_logs() as logs:
        await asyncio.sleep(0.15)
        time.sleep(0.4)  # noqa: ASYNC251 (the stall under test)
        await asyncio.sleep(0.15)
    assert 0.3 <= r.stats()["loop_lag_max_s"] < 2.0
    stalls = [e for e in logs if e["event"] == "rollout.loop_stalled"]
    assert len(stalls) == 1 and stalls[0]["lag_s"] >= 0.3 and stalls[0]["connect_timeout_s"] == 30.0
    await r.stop()
    await wait_for(run, 5)
