"""/generate with ``stream``: server-sent events as SGLang 0.5.23 sends them by default.

Measured against real SGLang (``RLACTORS_CONFORMANCE_SGLANG``): one event per decode step (an
event may repeat the last when a step added nothing to that sequence), each with the whole output
so far (text, ids, logprobs; ``finish_reason`` null), the last with the
finish reason and the weight-version spans; several sequences interleave, each event with its
``index``; then ``data: [DONE]``. A client that goes away aborts its requests.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx

from tests.conformance.sse import events
from tests.helpers.servers import wait_load

PROMPT = [101, 202, 303, 404, 505, 606, 707]
LONG = 4000  # still running when the client goes away


def greedy(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


def check_growth(evs: list[dict[str, Any]], n: int, logprobs: bool) -> None:
    """Cumulative events of one sequence: each extends the last; only the last is finished.

    An event may repeat the last one's output: SGLang's scheduler streams a request on every step
    at the default ``stream_interval`` of 1 without checking that the step added a token, and
    under load real SGLang was seen sending the same ``output_ids`` twice in a row.
    """
    lengths = {len(e["output_ids"]) for e in evs}
    assert len(lengths) >= 2  # not one event at the end: the output streams as it is generated
    for prev, cur in itertools.pairwise(evs):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert len(cur["output_ids"]) >= len(prev["output_ids"])
    for e in evs:
        meta = e["meta_info"]
        assert meta["completion_tokens"] == len(e["output_ids"])
        if logprobs:
            assert [t for _, t, _ in meta["output_token_logprobs"]] == e["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in evs[:-1])
    assert all("weight_versions" not in e["meta_info"] for e in evs[:-1])
    last = evs[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": n} and len(evs[-1]["output_ids"]) == n
    assert last["weight_versions"] == [{"version": last["weight_version"], "start": 0, "end": n}]


async def test_a_stream_sends_the_output_as_it_grows(client: httpx.AsyncClient) -> None:
    body = {"input_ids": PROMPT, "sampling_params": greedy(6), "return_logprob": True}
    evs = await events(client, body)
    check_growth(evs, 6, logprobs=True)
    assert all("index" not in e for e in evs)  # one sequence: no index
    assert len({e["meta_info"]["id"] for e in evs}) == 1
    whole = (await client.post("/generate", json=body)).json()
    assert evs[-1]["output_ids"] == whole["output_ids"] and evs[-1]["text"] == whole["text"]
    assert evs[-2]["text"] == whole["text"][: len(evs[-2]["text"])]  # the text so far, not a delta


async def test_streamed_sequences_interleave_with_their_index(client: httpx.AsyncClient) -> None:
    batch = {"input_ids": [PROMPT, PROMPT[:4]], "sampling_params": greedy(4)}
    n2 = {"input_ids": PROMPT, "sampling_params": {**greedy(4), "n": 2}}
    for body in (batch, n2):
        evs = await events(client, body)
        assert {e["index"] for e in evs} == {0, 1}
        whole = (await client.post("/generate", json=body)).json()
        for i in (0, 1):
            mine = [e for e in evs if e["index"] == i]
            check_growth(mine, 4, logprobs=False)
            assert len({e["meta_info"]["id"] for e in mine}) == 1
            assert mine[-1]["output_ids"] == whole[i]["output_ids"]


async def test_a_client_that_goes_away_aborts_its_stream(client: httpx.AsyncClient) -> None:
    body = {"input_ids": PROMPT, "sampling_params": greedy(LONG), "stream": True}
    async with client.stream("POST", "/generate", json=body) as r:
        lines = r.aiter_lines()
        first = await anext(lines)
        while not first:
            first = await anext(lines)
        assert json.loads(first[len("data: ") :])["meta_info"]["finish_reason"] is None
    # the response is closed with the request still decoding: the server stops it
    await wait_load(client, running=0, waiting=0)


async def test_stream_interval_sends_the_first_token_then_every_interval(client: httpx.AsyncClient) -> None:
    evs = await events(client, {"input_ids": PROMPT, "sampling_params": {**greedy(7), "stream_interval": 3}})
    sizes = [len(e["output_ids"]) for e in evs]
    assert sizes[0] == 1 and sizes[-1] == 7 and len(sizes) >= 2
    assert all(b - a >= 3 for a, b in itertools.pairwise(sizes[:-1]))  # SGLang: [1, 4, 7]


async def test_a_stream_holds_text_that_may_be_the_start_of_a_stop_string(client: httpx.AsyncClient) -> None:
    whole = (await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": greedy(6)})).json()
    three = (await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": greedy(3)})).json()
    stop = (
        whole["text"][len(three["text"]) :] + "\x00never"
    )  # what follows token 3, then text never generated
    evs = await events(client, {"input_ids": PROMPT, "sampling_params": {**greedy(6), "stop": [stop]}})
    shown = [e["text"] for e in evs[:-1]]
    assert shown and all(not t.endswith(stop[:i]) for t in shown for i in range(1, len(stop) + 1))
    # From token 4 on, the text could be the stop: no event before the last shows more than 3 tokens.
    # Not every length gets an event: SGLang's tokenizer manager sends only the newest of the outputs
    # queued while its client was slow (ours does the same under load).
    lengths = [len(e["output_ids"]) for e in evs[:-1]]
    assert lengths == sorted(lengths) and set(lengths) <= {1, 2, 3}
    assert evs[-1]["text"] == whole["text"] and evs[-1]["meta_info"]["finish_reason"]["type"] == "length"
