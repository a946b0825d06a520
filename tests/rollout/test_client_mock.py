"""SGLangClient against scripted servers on loopback sockets (tests/rollout/scripted.py): resume,
pause, retries, failover."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import pytest
from structlog.testing import capture_logs

from nodes.rollout.client import (
    ClientConfig,
    GenerationError,
    GenRequest,
    NoServerAvailableError,
    SGLangClient,
)
from rlactors.base.aio import wait_for
from tests.rollout.scripted import DROP, Answer, Script, Serve, answer, reply

FAST = ClientConfig(backoff_base_s=0.001, backoff_max_s=0.002, max_retries=2)


def record_posts(client: SGLangClient) -> list[str]:
    """The server of each post the client makes from now on, in the order it makes them."""
    sent: list[str] = []
    post = client._wire.post

    async def recording(url: str, *args: Any, **kw: Any) -> tuple[int, bytes]:
        sent.append(url)
        return await post(url, *args, **kw)

    client._wire.post = recording  # type: ignore[method-assign]
    return sent


async def test_abort_resume_appends_tokens_lowers_budget_and_stays_on_the_server(serve: Serve) -> None:
    script = Script(
        a=[lambda b: reply([5, 6, 7], "abort", message="paused"), lambda b: reply([8, 9], "length", cached=5)]
    )
    A, B = (await serve(script, "a", "b")).urls
    client = SGLangClient([A, B], FAST)
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


async def test_legacy_response_without_output_ids(serve: Serve) -> None:
    script = Script(a=[lambda b: reply([4, 2], "stop", legacy=True, matched=2)])
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 8}))
    assert res.output_ids == [4, 2] and res.finish_reason == "stop" and res.matched_stop == 2
    await client.aclose()


async def test_a_paused_client_holds_the_resumed_request_until_resume_and_stamps_versions(
    serve: Serve,
) -> None:
    first_done = asyncio.Event()

    def first(body: dict) -> Answer:
        client.pause()  # the trainer pauses the client, then the servers: the abort arrives while paused
        first_done.set()
        return reply([5, 6], "abort", message="paused")

    script = Script(a=[first, lambda b: reply([7], "length")])
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    client.pause()  # the trainer pauses the client before /pause_generation
    assert client.paused
    task = asyncio.create_task(client.agenerate(GenRequest([1], {"max_new_tokens": 3})))
    await asyncio.sleep(0)
    assert client.counters["posts"] == 0  # a new request waits too
    client.resume()
    await wait_for(first_done.wait(), 5)
    for _ in range(20):
        await asyncio.sleep(0)
    # the aborted request has not re-posted: it waits on the event, not on a timer
    assert client.counters["posts"] == 1 and len(script.posts) == 1
    client.set_version(1)
    client.resume()
    res = await wait_for(task, 5)
    assert res.output_ids == [5, 6, 7] and res.output_versions == [0, 0, 1]
    await client.aclose()


async def test_an_unlabelled_chunk_held_across_an_update_keeps_the_version_it_was_posted_at(
    serve: Serve,
) -> None:
    # real SGLang, pause mode retract/in_place: one chunk, part old weights, part new, no labels.
    # Stamping it with the version at arrival would call the old-weight tokens new.
    posted, gate = asyncio.Event(), asyncio.Event()

    async def held(body: dict) -> Answer:
        posted.set()
        await gate.wait()
        return reply([5, 6, 7], "length")

    script = Script(a=[held, lambda b: reply([8], "length")])
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    task = asyncio.create_task(client.agenerate(GenRequest([1], {"max_new_tokens": 3})))
    await wait_for(posted.wait(), 5)
    client.set_version(1)  # the servers were updated while the request was held
    gate.set()
    res = await wait_for(task, 5)
    assert res.output_versions == [0, 0, 0] and client.counters["labelled_tokens"] == 0
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 1}))  # posted after the update
    assert res.output_versions == [1]
    await client.aclose()


async def test_server_labels_stamp_each_token(serve: Serve) -> None:
    script = Script(
        a=[
            lambda b: reply([5, 6, 7, 8], "length", versions=["2", "2", "3", "3"]),  # held across 2 -> 3
            lambda b: reply(
                [5, 6], "length", versions=["default", "3"]
            ),  # unparseable: the post-time version
            lambda b: reply([5, 6], "length", versions=["3"]),  # misaligned: ignored
        ]
    )
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST, version=2)
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 4}))
    assert res.output_versions == [2, 2, 3, 3] and client.counters["labelled_tokens"] == 4
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 2}))
    assert res.output_versions == [2, 3] and client.counters["labelled_tokens"] == 5
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 2}))
    assert res.output_versions == [2, 2] and client.counters["labelled_tokens"] == 5
    await client.aclose()


async def test_5xx_is_retried_with_backoff_then_succeeds(serve: Serve) -> None:
    script = Script(a=[lambda b: answer(500), lambda b: answer(503), lambda b: reply([1], "stop")])
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    with capture_logs() as logs:
        res = await client.agenerate(GenRequest([9], {"max_new_tokens": 4}))
        assert res.output_ids == [1] and client.counters["retries"] == 2 and client.counters["failovers"] == 0
        assert len({b["rid"] for _, b in script.posts}) == 3  # each attempt has its own rid
        retries = [e for e in logs if e["event"] == "rollout.retry"]  # the first now, the second held back
        assert len(retries) == 1 and retries[0]["error"] == "HTTP 500: " and retries[0]["server"] == A
        await client.aclose()  # writes the count held back
    assert [e.get("repeats") for e in logs if e["event"] == "rollout.retry"] == [None, 1]


async def test_a_server_that_stays_down_loses_the_request_with_its_tokens_to_another(serve: Serve) -> None:
    calls = {"a": 0}

    def flaky_a(body: dict) -> Answer:
        calls["a"] += 1
        if calls["a"] == 1:
            return reply([5, 6], "abort", message="paused")
        return DROP  # the connection closes with no answer

    script = Script(a=[flaky_a], b=[lambda b: reply([7, 8], "length")])
    A, B = (await serve(script)).urls
    client = SGLangClient([A, B], FAST)
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


async def test_all_servers_down_raises_a_clear_error(serve: Serve) -> None:
    script = Script(a=[lambda b: answer(502)], b=[lambda b: answer(500)])
    A, B = (await serve(script)).urls
    client = SGLangClient([A, B], FAST)
    with pytest.raises(NoServerAvailableError, match="every server failed"):
        await client.agenerate(GenRequest([1], {"max_new_tokens": 2}))
    await client.aclose()


async def test_4xx_and_error_aborts_are_not_retried(serve: Serve) -> None:
    script = Script(a=[lambda b: answer(400, json={"error": "unknown field: foo"})])
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    with pytest.raises(GenerationError, match="unknown field"):
        await client.agenerate(GenRequest([1], {"foo": 1}))
    assert client.counters["retries"] == 0
    await client.aclose()
    script = Script(a=[lambda b: reply([], "abort", message="input too long", status_code=400)])
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    with pytest.raises(GenerationError, match="input too long"):
        await client.agenerate(GenRequest([1], {"max_new_tokens": 2}))
    await client.aclose()


async def test_new_requests_go_to_the_least_loaded_server_and_rids_stick(serve: Serve) -> None:
    gate = asyncio.Event()

    all_posted = asyncio.Event()

    async def held(body: dict) -> Answer:
        if len(script.posts) == 6:
            all_posted.set()
        await gate.wait()
        return reply([1], "stop")

    script = Script(a=[held], b=[held])
    A, B = (await serve(script)).urls
    client = SGLangClient([A, B], FAST)
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


async def test_resume_wakes_held_requests_a_server_at_a_time_in_turn(serve: Serve) -> None:
    """Held in the order their aborts came back (a server's all together), requests re-post
    round-robin over the servers: the last server does not wait for every other server's re-posts."""
    script = Script(a=[lambda b: reply([7], "length")], b=[lambda b: reply([7], "length")])
    A, B = (await serve(script)).urls
    client = SGLangClient([A, B], FAST)
    client.pause()
    tasks = []
    for rid, url in [("a0", A), ("a1", A), ("a2", A), ("b0", B), ("b1", B), ("b2", B)]:
        client._sticky[rid] = url  # route each request to its server
        tasks.append(asyncio.create_task(client.agenerate(GenRequest([1], {"max_new_tokens": 1}, rid=rid))))
    for _ in range(5):
        await asyncio.sleep(0)
    sent = record_posts(client)
    assert client.counters["posts"] == 0  # all held
    client.resume()
    await wait_for(asyncio.gather(*tasks), 5)
    assert sent == [A, B, A, B, A, B]  # the order the client posts in (their arrival may differ)
    _, first, last, reposts, every_server = client.reposts[-1]
    assert reposts == 6 and first <= every_server <= last
    await client.aclose()


async def test_reposted_returns_once_every_server_has_its_first_held_request_posting(serve: Serve) -> None:
    """PolicySync continues the servers after ``resume()``: by then each server that had held
    requests must have one posting again (a paused server holds it), so none continues idle."""
    gate = asyncio.Event()

    async def slow(b: dict) -> Answer:
        await gate.wait()
        return reply([7], "length")

    script = Script(a=[slow], b=[slow])
    A, B = (await serve(script)).urls
    client = SGLangClient([A, B], FAST)
    await wait_for(client.reposted(), 1)  # nothing held: at once
    client.pause()
    tasks = []
    for rid, url in [("a0", A), ("a1", A), ("a2", A), ("b0", B)]:
        client._sticky[rid] = url
        tasks.append(asyncio.create_task(client.agenerate(GenRequest([1], {"max_new_tokens": 1}, rid=rid))))
    for _ in range(5):
        await asyncio.sleep(0)
    sent = record_posts(client)
    client.resume()
    await wait_for(client.reposted(), 1)
    assert set(sent) == {A, B}  # each server has its first held request posting
    gate.set()
    await wait_for(asyncio.gather(*tasks), 5)
    await client.aclose()


async def test_reposted_does_not_wait_for_a_held_request_whose_task_was_cancelled(serve: Serve) -> None:
    script = Script(a=[lambda b: reply([7], "length")])
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    client.pause()
    task = asyncio.create_task(client.agenerate(GenRequest([1], {"max_new_tokens": 1}, rid="x")))
    for _ in range(3):
        await asyncio.sleep(0)
    client.resume()  # wakes it; it is cancelled before it runs
    task.cancel()
    await wait_for(client.reposted(timeout_s=30), 5)  # not the 30 s timeout
    assert task.cancelled()
    await client.aclose()


async def test_server_urls_are_checked_when_the_client_is_made_and_https_goes_over_tls() -> None:
    with pytest.raises(ValueError, match="expected http://host"):
        SGLangClient(["ftp://a:1"], FAST)
    with pytest.raises(ValueError, match="expected http://host"):
        SGLangClient(["http://"], FAST)
    client = SGLangClient(["https://a.example/v1", "http://b.example"], FAST)
    (tls, prefix), (plain, _) = (
        client._wire.pool("https://a.example/v1"),
        client._wire.pool("http://b.example"),
    )
    assert (tls.port, prefix, plain.port) == (443, "/v1", 80)
    assert tls.ssl is not None and tls.ssl.verify_mode == ssl.CERT_REQUIRED and plain.ssl is None
    await client.aclose()
