"""SGLangClient against scripted servers (httpx.MockTransport): resume, pause, retries, failover."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from nodes.rollout.client import (
    ClientConfig,
    GenerationError,
    GenRequest,
    NoServerAvailableError,
    SGLangClient,
)
from protocols.sglang import weight_version_spans
from rlactors.aio import wait_for

A, B = "http://a:1", "http://b:1"
FAST = ClientConfig(backoff_base_s=0.001, backoff_max_s=0.002, max_retries=2)


def reply(
    ids: list[int],
    finish: str = "length",
    cached: int = 0,
    legacy: bool = False,
    versions: list[Any] | None = None,
    **fin: Any,
) -> httpx.Response:
    meta: dict[str, Any] = {
        "finish_reason": {"type": finish, **fin},
        "prompt_tokens": 0,
        "completion_tokens": len(ids),
        "cached_tokens": cached,
        "weight_version": "w",
        "output_token_logprobs": [[-0.25, t, None] for t in ids],
    }
    if versions is not None:
        meta["weight_versions"] = weight_version_spans(versions, "w")  # as SGLang 0.5.23 sends them
    body: dict[str, Any] = {"text": "".join(chr(97 + t % 26) for t in ids), "meta_info": meta}
    if not legacy:
        body["output_ids"] = ids
    return httpx.Response(200, json=body)


class Script:
    """Records every /generate post and answers from a per-host list of responders."""

    def __init__(self, **per_host: list[Callable[[dict], Any]]) -> None:
        self.per_host = {h: list(v) for h, v in per_host.items()}
        self.posts: list[tuple[str, dict]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/abort_request":
            return httpx.Response(200)
        body = json.loads(request.content)
        self.posts.append((host, body))
        responder = self.per_host[host].pop(0) if len(self.per_host[host]) > 1 else self.per_host[host][0]
        out = responder(body)
        return await out if asyncio.iscoroutine(out) else out

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


async def test_abort_resume_appends_tokens_lowers_budget_and_stays_on_the_server() -> None:
    script = Script(
        a=[lambda b: reply([5, 6, 7], "abort", message="paused"), lambda b: reply([8, 9], "length", cached=5)]
    )
    client = SGLangClient([A, B], FAST, transport=script.transport())
    client._servers[B].inflight = 10  # make A the least loaded
    res = await client.agenerate(GenRequest([1, 2, 3], {"max_new_tokens": 5, "temperature": 1.0}, rid="r1"))
    assert res.output_ids == [5, 6, 7, 8, 9] and res.output_logprobs == [-0.25] * 5
    assert res.finish_reason == "length" and res.aborts == 1 and res.posts == 2 and res.server == A
    (h1, b1), (h2, b2) = script.posts
    assert h1 == h2 == "a"
    assert b1["input_ids"] == [1, 2, 3] and b1["sampling_params"]["max_new_tokens"] == 5
    assert b2["input_ids"] == [1, 2, 3, 5, 6, 7] and b2["sampling_params"]["max_new_tokens"] == 2
    assert b1["return_logprob"] and b1["rid"] == "r1" and b2["rid"] != "r1" and b2["rid"].startswith("r1")
    assert res.cached_tokens == [0, 5]
    assert (
        client.counters["aborts"] == 1
        and client.counters["resumes"] == 1
        and client.counters["cached_tokens"] == 5
    )
    await client.aclose()


async def test_legacy_response_without_output_ids() -> None:
    script = Script(a=[lambda b: reply([4, 2], "stop", legacy=True, matched=2)])
    client = SGLangClient([A], FAST, transport=script.transport())
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 8}))
    assert res.output_ids == [4, 2] and res.finish_reason == "stop" and res.matched_stop == 2
    await client.aclose()


async def test_a_paused_client_holds_the_resumed_request_until_resume_and_stamps_versions() -> None:
    first_done = asyncio.Event()

    def first(body: dict) -> httpx.Response:
        client.pause()  # the trainer pauses the client, then the servers: the abort arrives while paused
        first_done.set()
        return reply([5, 6], "abort", message="paused")

    script = Script(a=[first, lambda b: reply([7], "length")])
    client = SGLangClient([A], FAST, transport=script.transport())
    client.pause()  # the trainer pauses the client before /pause_generation
    assert client.paused
    task = asyncio.create_task(client.agenerate(GenRequest([1], {"max_new_tokens": 3})))
    await asyncio.sleep(0)
    assert not script.posts  # a new request waits too
    client.resume()
    await wait_for(first_done.wait(), 5)
    for _ in range(20):
        await asyncio.sleep(0)
    # the aborted request has not re-posted: it waits on the event, not on a timer
    assert len(script.posts) == 1
    client.set_version(1)
    client.resume()
    res = await wait_for(task, 5)
    assert res.output_ids == [5, 6, 7] and res.output_versions == [0, 0, 1]
    await client.aclose()


async def test_an_unlabelled_chunk_held_across_an_update_keeps_the_version_it_was_posted_at() -> None:
    # real SGLang, pause mode retract/in_place: one chunk, part old weights, part new, no labels.
    # Stamping it with the version at arrival would call the old-weight tokens new.
    posted, gate = asyncio.Event(), asyncio.Event()

    async def held(body: dict) -> httpx.Response:
        posted.set()
        await gate.wait()
        return reply([5, 6, 7], "length")

    script = Script(a=[held, lambda b: reply([8], "length")])
    client = SGLangClient([A], FAST, transport=script.transport())
    task = asyncio.create_task(client.agenerate(GenRequest([1], {"max_new_tokens": 3})))
    await wait_for(posted.wait(), 5)
    client.set_version(1)  # the servers were updated while the request was held
    gate.set()
    res = await wait_for(task, 5)
    assert res.output_versions == [0, 0, 0] and client.counters["labelled_tokens"] == 0
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 1}))  # posted after the update
    assert res.output_versions == [1]
    await client.aclose()


async def test_server_labels_stamp_each_token() -> None:
    script = Script(a=[
        lambda b: reply([5, 6, 7, 8], "length", versions=["2", "2", "3", "3"]),  # held across 2 -> 3
        lambda b: reply([5, 6], "length", versions=["default", "3"]),  # unparseable: the post-time version
        lambda b: reply([5, 6], "length", versions=["3"]),  # misaligned: ignored
    ])  # fmt: skip
    client = SGLangClient([A], FAST, version=2, transport=script.transport())
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 4}))
    assert res.output_versions == [2, 2, 3, 3] and client.counters["labelled_tokens"] == 4
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 2}))
    assert res.output_versions == [2, 3] and client.counters["labelled_tokens"] == 5
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 2}))
    assert res.output_versions == [2, 2] and client.counters["labelled_tokens"] == 5
    await client.aclose()


async def test_5xx_is_retried_with_backoff_then_succeeds() -> None:
    script = Script(
        a=[lambda b: httpx.Response(500), lambda b: httpx.Response(503), lambda b: reply([1], "stop")]
    )
    client = SGLangClient([A], FAST, transport=script.transport())
    with capture_logs() as logs:
        res = await client.agenerate(GenRequest([9], {"max_new_tokens": 4}))
        assert res.output_ids == [1] and client.counters["retries"] == 2 and client.counters["failovers"] == 0
        assert len({b["rid"] for _, b in script.posts}) == 3  # each attempt has its own rid
        retries = [e for e in logs if e["event"] == "rollout.retry"]  # the first now, the second held back
        assert len(retries) == 1 and retries[0]["error"] == "HTTP 500: " and retries[0]["server"] == A
        await client.aclose()  # writes the count held back
    assert [e.get("repeats") for e in logs if e["event"] == "rollout.retry"] == [None, 1]


async def test_a_server_that_stays_down_loses_the_request_with_its_tokens_to_another() -> None:
    calls = {"a": 0}

    def flaky_a(body: dict) -> httpx.Response:
        calls["a"] += 1
        if calls["a"] == 1:
            return reply([5, 6], "abort", message="paused")
        raise httpx.ConnectError("refused")

    script = Script(a=[flaky_a], b=[lambda b: reply([7, 8], "length")])
    client = SGLangClient([A, B], FAST, transport=script.transport())
    client._servers[B].inflight = 5
    res = await client.agenerate(GenRequest([1, 2], {"max_new_tokens": 4}, rid="x"))
    assert res.output_ids == [5, 6, 7, 8] and res.server == B and res.failovers == 1
    host, body = script.posts[-1]
    assert (
        host == "b" and body["input_ids"] == [1, 2, 5, 6] and body["sampling_params"]["max_new_tokens"] == 2
    )
    assert client.counters["retries"] == FAST.max_retries and client.counters["failovers"] == 1
    client._servers[B].inflight = 0
    # A is marked down: the next request (even one sticky to A) goes to B without touching A
    n_a = calls["a"]
    await client.agenerate(GenRequest([3], {"max_new_tokens": 2}, rid="x"))
    assert calls["a"] == n_a
    await client.aclose()


async def test_all_servers_down_raises_a_clear_error() -> None:
    script = Script(a=[lambda b: httpx.Response(502)], b=[lambda b: httpx.Response(500)])
    client = SGLangClient([A, B], FAST, transport=script.transport())
    with pytest.raises(NoServerAvailableError, match="every server failed"):
        await client.agenerate(GenRequest([1], {"max_new_tokens": 2}))
    await client.aclose()


async def test_4xx_and_error_aborts_are_not_retried() -> None:
    script = Script(a=[lambda b: httpx.Response(400, json={"error": "unknown field: foo"})])
    client = SGLangClient([A], FAST, transport=script.transport())
    with pytest.raises(GenerationError, match="unknown field"):
        await client.agenerate(GenRequest([1], {"foo": 1}))
    assert client.counters["retries"] == 0
    script = Script(a=[lambda b: reply([], "abort", message="input too long", status_code=400)])
    client = SGLangClient([A], FAST, transport=script.transport())
    with pytest.raises(GenerationError, match="input too long"):
        await client.agenerate(GenRequest([1], {"max_new_tokens": 2}))
    await client.aclose()


async def test_new_requests_go_to_the_least_loaded_server_and_rids_stick() -> None:
    gate = asyncio.Event()

    all_posted = asyncio.Event()

    async def held(body: dict) -> httpx.Response:
        if len(script.posts) == 6:
            all_posted.set()
        await gate.wait()
        return reply([1], "stop")

    script = Script(a=[held], b=[held])
    client = SGLangClient([A, B], FAST, transport=script.transport())
    tasks = [asyncio.create_task(client.agenerate(GenRequest([i], {"max_new_tokens": 1}))) for i in range(6)]
    await wait_for(all_posted.wait(), 5)
    assert client.load() == {A: 3, B: 3}
    gate.set()
    results = await asyncio.gather(*tasks)
    assert {r.server for r in results} == {A, B}
    # a reused rid (the next turn of an episode) goes back to its server even when that is busier
    first = results[0]
    other = B if first.server == A else A
    client._servers[first.server].inflight = 4
    again = await client.agenerate(GenRequest([0, 1, 2], {"max_new_tokens": 1}, rid=first.rid))
    assert again.server == first.server != other
    await client.aclose()


async def test_resume_wakes_held_requests_a_server_at_a_time_in_turn() -> None:
    """Held in the order their aborts came back (a server's all together), requests re-post
    round-robin over the servers: the last server does not wait for every other server's re-posts."""
    script = Script(a=[lambda b: reply([7], "length")], b=[lambda b: reply([7], "length")])
    client = SGLangClient([A, B], FAST, transport=script.transport())
    client.pause()
    tasks = []
    for rid, url in [("a0", A), ("a1", A), ("a2", A), ("b0", B), ("b1", B), ("b2", B)]:
        client._sticky[rid] = url  # route each request to its server
        tasks.append(asyncio.create_task(client.agenerate(GenRequest([1], {"max_new_tokens": 1}, rid=rid))))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not script.posts  # all held
    client.resume()
    await wait_for(asyncio.gather(*tasks), 5)
    assert [h for h, _ in script.posts] == ["a", "b", "a", "b", "a", "b"]
    _, first, last, reposts, every_server = client.reposts[-1]
    assert reposts == 6 and first <= every_server <= last
    await client.aclose()


async def test_reposted_returns_once_every_server_has_its_first_held_request_posting() -> None:
    """PolicySync continues the servers after ``resume()``: by then each server that had held
    requests must have one posting again (a paused server holds it), so none continues idle."""
    gate = asyncio.Event()

    async def slow(b: dict) -> httpx.Response:
        await gate.wait()
        return reply([7], "length")

    script = Script(a=[slow], b=[slow])
    client = SGLangClient([A, B], FAST, transport=script.transport())
    await wait_for(client.reposted(), 1)  # nothing held: at once
    client.pause()
    tasks = []
    for rid, url in [("a0", A), ("a1", A), ("a2", A), ("b0", B)]:
        client._sticky[rid] = url
        tasks.append(asyncio.create_task(client.agenerate(GenRequest([1], {"max_new_tokens": 1}, rid=rid))))
    for _ in range(5):
        await asyncio.sleep(0)
    client.resume()
    await wait_for(client.reposted(), 1)
    assert {h for h, _ in script.posts} == {"a", "b"}  # each server's first is out, not all
    gate.set()
    await wait_for(asyncio.gather(*tasks), 5)
    await client.aclose()


async def test_reposted_does_not_wait_for_a_held_request_whose_task_was_cancelled() -> None:
    script = Script(a=[lambda b: reply([7], "length")])
    client = SGLangClient([A], FAST, transport=script.transport())
    client.pause()
    task = asyncio.create_task(client.agenerate(GenRequest([1], {"max_new_tokens": 1}, rid="x")))
    for _ in range(3):
        await asyncio.sleep(0)
    client.resume()  # wakes it; it is cancelled before it runs
    task.cancel()
    await wait_for(client.reposted(timeout_s=30), 5)  # not the 30 s timeout
    assert task.cancelled()
    await client.aclose()
