"""/generate: response shape, finish reasons, logprob format, errors, and the prefix cache."""

from __future__ import annotations

import asyncio

import httpx

from tests.helpers.servers import wait_decoding, wait_load

PROMPT = [101, 202, 303, 404, 505, 606, 707]
LONG = 4000  # long enough to still run when aborted or paused; within the 8192-token context


def greedy(max_new_tokens: int, **extra: object) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, **extra}


async def test_generate_response_shape(client: httpx.AsyncClient, is_reference: bool) -> None:
    r = await client.post(
        "/generate",
        json={"input_ids": PROMPT, "sampling_params": greedy(8, ignore_eos=True), "return_logprob": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) >= {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert isinstance(body["text"], str)
    assert len(body["output_ids"]) == 8 == meta["completion_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(PROMPT)
    assert isinstance(meta["cached_tokens"], int) and 0 <= meta["cached_tokens"] < len(PROMPT)
    assert isinstance(meta["weight_version"], str)
    # SGLang 0.5.23: which weights sampled which output tokens, as [start, end) spans
    assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": 8}]
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["e2e_latency"] >= 0
    lps = meta["output_token_logprobs"]
    assert len(lps) == 8
    for (lp, tid, text), out_id in zip(lps, body["output_ids"], strict=True):
        assert isinstance(lp, float) and lp <= 0.0
        assert tid == out_id
        assert text is None


async def test_no_logprobs_unless_asked(client: httpx.AsyncClient) -> None:
    r = await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": greedy(2)})
    assert "output_token_logprobs" not in r.json()["meta_info"]


async def test_greedy_is_deterministic(client: httpx.AsyncClient) -> None:
    body = {"input_ids": PROMPT, "sampling_params": greedy(12, ignore_eos=True)}
    a, b = await asyncio.gather(client.post("/generate", json=body), client.post("/generate", json=body))
    assert a.json()["output_ids"] == b.json()["output_ids"]


async def test_stop_token_is_kept_in_output_ids(client: httpx.AsyncClient) -> None:
    ref = (
        await client.post(
            "/generate", json={"input_ids": PROMPT, "sampling_params": greedy(10, ignore_eos=True)}
        )
    ).json()
    out = ref["output_ids"]
    i = next((k for k in range(1, 10) if out[k] not in out[:k]), 0)  # the first token of its kind
    r = await client.post(
        "/generate", json={"input_ids": PROMPT, "sampling_params": greedy(10, stop_token_ids=[out[i]])}
    )
    body = r.json()
    assert body["output_ids"] == out[: i + 1]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": out[i]}
    assert body["meta_info"]["completion_tokens"] == i + 1
    # as in SGLang, ignore_eos turns stop_token_ids off too
    r = await client.post(
        "/generate",
        json={"input_ids": PROMPT, "sampling_params": greedy(10, stop_token_ids=[out[i]], ignore_eos=True)},
    )
    assert r.json()["output_ids"] == out


async def test_unknown_sampling_key_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "bogus_key": 1}}
    )
    assert r.status_code == 400
    assert "error" in r.json()


async def test_bad_sampling_value_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"top_p": 0.0}})
    assert r.status_code == 400


async def test_duplicate_inflight_rid_is_400(client: httpx.AsyncClient) -> None:
    long = {"input_ids": PROMPT, "rid": "dup-rid-1", "sampling_params": greedy(LONG, ignore_eos=True)}
    first = asyncio.create_task(client.post("/generate", json=long))
    try:
        await wait_load(client, running=1)
        r = await client.post("/generate", json=long)
        assert r.status_code == 400
        assert "error" in r.json()
    finally:
        await client.post("/abort_request", json={"rid": "dup-rid-1"})
    first_body = (await first).json()
    assert first_body["meta_info"]["finish_reason"]["type"] == "abort"
    # the rid is free again once the first request has returned
    again = await client.post("/generate", json={**long, "sampling_params": greedy(1)})
    assert again.status_code == 200


async def test_n_samples_and_batch_return_lists(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "n": 3}}
    )
    assert r.status_code == 200 and isinstance(r.json(), list) and len(r.json()) == 3
    r = await client.post("/generate", json={"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": greedy(2)})
    body = r.json()
    assert isinstance(body, list) and [b["meta_info"]["prompt_tokens"] for b in body] == [len(PROMPT), 3]


async def test_text_input(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/generate", json={"text": "The capital of France is", "sampling_params": greedy(4)}
    )
    assert r.status_code == 200
    body = r.json()
    assert isinstance(body["text"], str) and body["meta_info"]["prompt_tokens"] > 0


async def test_cached_tokens_sequence(client: httpx.AsyncClient) -> None:
    """SGLang's own test_cache_tokens sequence (test_srt_endpoint.py), scaled down 10x to fit the
    tiny model's 8192-token context."""
    assert (await client.post("/flush_cache")).status_code == 200

    async def cached(n0: int, n1: int) -> int:
        r = await client.post(
            "/generate", json={"input_ids": list(range(n0, n1)), "sampling_params": greedy(1)}
        )
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    assert await cached(0, 10) == 0
    assert await cached(0, 1000) == 10
    assert await cached(0, 1000) == 999
    assert await cached(0, 100) == 99
    assert await cached(0, 1100) == 1000


async def test_resumed_request_hits_prefix_cache(client: httpx.AsyncClient) -> None:
    """An aborted request's KV is cached: re-posting prompt + partial output skips that prefill."""
    prompt = list(range(1000, 1300))
    task = asyncio.create_task(
        client.post(
            "/generate",
            json={"input_ids": prompt, "rid": "resume-1", "sampling_params": greedy(LONG, ignore_eos=True)},
        )
    )
    await wait_decoding(client)
    await client.post("/abort_request", json={"rid": "resume-1"})
    partial = (await task).json()
    assert partial["meta_info"]["finish_reason"]["type"] == "abort"
    resumed_ids = prompt + partial["output_ids"]
    r = await client.post(
        "/generate", json={"input_ids": resumed_ids, "sampling_params": greedy(4, ignore_eos=True)}
    )
    assert r.json()["meta_info"]["cached_tokens"] == len(resumed_ids) - 1


async def test_new_request_joins_a_running_batch(client: httpx.AsyncClient) -> None:
    long = asyncio.create_task(
        client.post(
            "/generate",
            json={
                "input_ids": PROMPT,
                "rid": "join-long",
                "sampling_params": greedy(LONG, ignore_eos=True),
            },
        )
    )
    try:
        await wait_load(client, running=1)
        short = await client.post(
            "/generate", json={"input_ids": PROMPT[:3], "sampling_params": greedy(5, ignore_eos=True)}
        )
        assert short.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
        assert not long.done()  # the short one joined, finished and left while the long one kept running
    finally:
        await client.post("/abort_request", json={"rid": "join-long"})
    await long


async def test_hundreds_of_concurrent_requests_are_batched(
    client: httpx.AsyncClient, is_reference: bool
) -> None:
    info = (await client.get("/server_info")).json()
    steps_before = info["internal_states"][0]["steps"] if is_reference else 0
    n, new = 300, 8
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120, limits=limits) as many:
        rs = await asyncio.gather(
            *[
                many.post(
                    "/generate",
                    json={
                        "input_ids": [7, 8, 9, i],
                        "sampling_params": {"max_new_tokens": new, "ignore_eos": True},
                    },
                )
                for i in range(n)
            ]
        )
    assert all(r.status_code == 200 and len(r.json()["output_ids"]) == new for r in rs)
    if is_reference:
        steps = (await client.get("/server_info")).json()["internal_states"][0]["steps"] - steps_before
        assert steps < n * new / 2  # several requests (up to MAX_RUNNING) advanced per decode step


async def test_input_ids_win_over_text(client: httpx.AsyncClient) -> None:
    """SGLang 0.5.23 accepts both and generates from ``input_ids``."""
    r = await client.post(
        "/generate", json={"input_ids": PROMPT, "text": "both", "sampling_params": greedy(2)}
    )
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["prompt_tokens"] == len(PROMPT)
