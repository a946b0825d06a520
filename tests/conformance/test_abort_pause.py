"""Abort (running, waiting, all), pause modes abort/retract/in_place, continue, flush_cache rules.

Written to what SGLang 0.5.23 shows a client: a request sent during a pause waits in its
tokenizer manager (invisible to ``/v1/loads``, whose snapshot also stops during a pause), so
the tests see "held" as "not answered" and count retractions with ``meta_info.num_retractions``;
a request waits in the scheduler's queue only when ``max_running_requests`` are running; an
abort may still be leaving the scheduler when ``/abort_request`` and the request have answered.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from rlactors.base.aio import wait_for
from tests.conformance.conftest import MAX_RUNNING
from tests.helpers.servers import wait_decoding, wait_load, wait_until

PROMPT = list(range(2000, 2040))


def long_req(rid: str, prompt: list[int] = PROMPT, max_new_tokens: int = 4000) -> dict:
    return {
        "input_ids": prompt,
        "rid": rid,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    }


async def test_abort_running_returns_partial_output(client: httpx.AsyncClient) -> None:
    task = asyncio.create_task(client.post("/generate", json=long_req("abort-run-1")))
    await wait_decoding(client)
    r = await client.post("/abort_request", json={"rid": "abort-run-1"})
    assert r.status_code == 200
    resp = await task
    assert resp.status_code == 200
    body = resp.json()
    assert body["meta_info"]["finish_reason"]["type"] == "abort"
    assert body["meta_info"]["completion_tokens"] == len(body["output_ids"])


async def test_abort_all(client: httpx.AsyncClient) -> None:
    tasks = [asyncio.create_task(client.post("/generate", json=long_req(f"abort-all-{i}"))) for i in range(3)]
    await wait_load(client, running=3)
    await client.post("/abort_request", json={"abort_all": True})
    for t in tasks:
        assert (await t).json()["meta_info"]["finish_reason"]["type"] == "abort"


async def test_abort_unknown_rid_is_harmless(client: httpx.AsyncClient) -> None:
    assert (await client.post("/abort_request", json={"rid": "no-such-request"})).status_code == 200


async def held(task: asyncio.Task, seconds: float = 1.0) -> bool:
    """True if ``task`` (a request a paused server should hold) has no answer after ``seconds``;
    an unpaused server answers these short requests in milliseconds."""
    done, _ = await asyncio.wait([task], timeout=seconds)
    return not done


async def flushed(client: httpx.AsyncClient) -> None:
    """Flush once the server allows it (an abort may still be leaving the scheduler)."""

    async def ok() -> bool:
        return (await client.post("/flush_cache")).status_code == 200

    await wait_until(ok, what="/flush_cache to be allowed")


async def test_abort_waiting_request(client: httpx.AsyncClient) -> None:
    full = [
        asyncio.create_task(client.post("/generate", json=long_req(f"abort-wait-fill-{i}")))
        for i in range(MAX_RUNNING)
    ]
    try:
        await wait_load(client, running=MAX_RUNNING)
        task = asyncio.create_task(client.post("/generate", json=long_req("abort-wait-1", max_new_tokens=4)))
        await wait_load(client, waiting=1)
        await client.post("/abort_request", json={"rid": "abort-wait-1"})
        body = (await task).json()
    finally:
        await client.post("/abort_request", json={"abort_all": True})
        await asyncio.gather(*full)
    assert body["meta_info"]["finish_reason"]["type"] == "abort"
    assert body["output_ids"] == [] and body["meta_info"]["completion_tokens"] == 0


async def test_pause_abort_returns_everything_then_blocks_new_requests(client: httpx.AsyncClient) -> None:
    tasks = [
        asyncio.create_task(client.post("/generate", json=long_req(f"pause-abort-{i}"))) for i in range(2)
    ]
    await wait_load(client, running=2)
    r = await client.post("/pause_generation", json={"mode": "abort"})
    assert r.status_code == 200
    try:
        for t in tasks:
            assert (await t).json()["meta_info"]["finish_reason"]["type"] == "abort"
        late = asyncio.create_task(
            client.post("/generate", json=long_req("pause-abort-late", max_new_tokens=3))
        )
        assert await held(late)
    finally:
        await client.post("/continue_generation", json={})
    body = (await late).json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


async def _uninterrupted(client: httpx.AsyncClient, prompt: list[int], n: int) -> list[int]:
    r = await client.post("/generate", json=long_req("ref-" + str(prompt[0]), prompt, n))
    return r.json()["output_ids"]


async def test_pause_retract_requeues_and_continue_finishes(client: httpx.AsyncClient) -> None:
    prompt, n = list(range(3000, 3030)), 3000  # long enough to be running when the pause lands
    task = asyncio.create_task(client.post("/generate", json=long_req("retract-1", prompt, n)))
    await wait_decoding(client)
    await client.post("/pause_generation", json={"mode": "retract"})
    try:
        assert await held(task)
    finally:
        await client.post("/continue_generation", json={})
    body = (await task).json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    assert body["meta_info"]["num_retractions"] == 1
    assert body["output_ids"] == await _uninterrupted(client, prompt, n)


async def test_pause_in_place_keeps_requests_running(client: httpx.AsyncClient) -> None:
    prompt, n = list(range(4000, 4030)), 3000  # long enough to be running when the pause lands
    task = asyncio.create_task(client.post("/generate", json=long_req("inplace-1", prompt, n)))
    await wait_decoding(client)
    await client.post("/pause_generation", json={"mode": "in_place"})
    try:
        await wait_load(client, running=1, waiting=0)
        assert not task.done()
        # a flush is refused while a request is held in place
        assert (await client.post("/flush_cache")).status_code == 400
    finally:
        await client.post("/continue_generation", json={})
    body = (await task).json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    assert body["output_ids"] == await _uninterrupted(client, prompt, n)


async def test_flush_cache_refused_while_running(client: httpx.AsyncClient) -> None:
    task = asyncio.create_task(client.post("/generate", json=long_req("flush-1")))
    await wait_decoding(client)
    try:
        r = await client.post("/flush_cache")
        assert r.status_code == 400
    finally:
        await client.post("/abort_request", json={"rid": "flush-1"})
    await task
    await flushed(client)
    r = await client.get("/flush_cache")
    assert r.status_code == 200 and "Cache flushed" in r.text


async def test_health_and_info(client: httpx.AsyncClient, is_reference: bool) -> None:
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/health_generate")).status_code == 200
    info = (await client.get("/model_info")).json()
    assert {"model_path", "weight_version", "is_generation"} <= set(info)
    assert (await client.get("/get_model_info")).json() == info  # deprecated name, still served
    server = (await client.get("/server_info")).json()
    assert "version" in server and server["tp_size"] == 1
    loads = (await client.get("/v1/loads")).json()["loads"]
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens"} <= set(loads[0])
    if is_reference:
        assert server["internal_states"][0]["num_running_reqs"] == 0


async def test_client_disconnect_aborts_request(client: httpx.AsyncClient, server_url: str) -> None:
    async with httpx.AsyncClient(base_url=server_url, timeout=120.0) as other:
        task = asyncio.create_task(other.post("/generate", json=long_req("disconnect-1")))
        await wait_load(client, running=1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await wait_load(client, running=0, waiting=0)
    # the rid is free again
    r = await client.post("/generate", json=long_req("disconnect-1", max_new_tokens=1))
    assert r.status_code == 200


async def test_our_client_re_posts_to_the_paused_server_which_holds_it_until_continue(
    client: httpx.AsyncClient, server_url: str
) -> None:
    """PolicySync's order: the pause aborts a running request; our client holds it, re-posts it
    (prompt + its tokens) to the still paused server on resume, and the server holds it until
    ``/continue_generation``; it then finishes as if never cut, its prefix from the cache."""
    from nodes.rollout.client import GenRequest, SGLangClient

    prompt, n = list(range(5000, 5030)), 400
    ours = SGLangClient([server_url])
    try:
        task = asyncio.create_task(
            ours.agenerate(
                GenRequest(prompt, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}, "held-1")
            )
        )
        await wait_decoding(client)
        ours.pause()
        await client.post("/pause_generation", json={"mode": "abort"})
        try:

            async def aborted() -> bool:
                return ours.counters["aborts"] >= 1

            await wait_until(aborted, what="the abort answer")
            ours.resume()
            await wait_for(ours.reposted(timeout_s=30), 30)  # re-posted: the paused server holds it
            assert ours.counters["resumes"] == 1
            assert await held(task)
        finally:
            await client.post("/continue_generation", json={})
        res = await wait_for(task, 120)
    finally:
        await ours.aclose()
    assert res.finish_reason == "length" and len(res.output_ids) == n
    assert res.output_ids == await _uninterrupted(client, prompt, n)
    assert res.aborts == 1 and res.posts == 2
    assert res.cached_tokens[1] >= len(prompt)  # the re-post's prefix came from the cache
