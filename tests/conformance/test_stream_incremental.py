"""/generate with ``stream`` on a server started with ``--incremental-streaming-output``: each
event carries only what is new since the sequence's previous one (output ids, text, and the
per-output-token log-prob lists), the last one with the finish reason.

Runs against a reference server (sim) started with the flag, or, in the SGLang stage
(``RLACTORS_CONFORMANCE_SGLANG``), real SGLang started with it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conformance.sse import events
from tests.helpers.servers import serving, start_reference_server, start_sglang_server

FLAG = "--incremental-streaming-output"
PROMPT = [101, 202, 303, 404, 505, 606, 707]


def greedy(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def incremental_url(tiny_ckpt: Path) -> Iterator[str]:
    if os.environ.get("RLACTORS_CONFORMANCE_URL"):
        pytest.skip("needs a server started with --incremental-streaming-output")
    sglang = os.environ.get("RLACTORS_CONFORMANCE_SGLANG")
    if sglang:
        yield from serving(start_sglang_server(sglang, str(tiny_ckpt), [FLAG]))
    else:
        yield from serving(
            start_reference_server(
                ["--backend", "sim", "--model-path", str(tiny_ckpt), "--sim-decode-s-base", "0.002", FLAG]
            )
        )


@pytest.fixture
async def inc(incremental_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=incremental_url, timeout=120.0) as c:
        yield c


def check_deltas(evs: list[dict[str, Any]], whole: dict[str, Any], top: int = 0) -> None:
    """Deltas of one sequence add up to the whole answer; each event's log-probs are its own tokens'."""
    assert len(evs) >= 2  # the output streams as it is generated
    assert all(e["output_ids"] for e in evs[:-1])  # no empty delta before the last
    assert [t for e in evs for t in e["output_ids"]] == whole["output_ids"]
    assert "".join(e["text"] for e in evs) == whole["text"]
    total = 0
    for e in evs:
        meta = e["meta_info"]
        total += len(e["output_ids"])
        assert meta["completion_tokens"] == total  # the count so far, not the delta's
        assert [t for _, t, _ in meta["output_token_logprobs"]] == e["output_ids"]
        if top:
            assert [row[0][1] for row in meta["output_top_logprobs"]] == e["output_ids"]  # greedy: top-1
    assert all(e["meta_info"]["finish_reason"] is None for e in evs[:-1])
    assert evs[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    lps = [x[0] for e in evs for x in e["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx([x[0] for x in whole["meta_info"]["output_token_logprobs"]], abs=1e-4)


async def test_each_event_carries_what_is_new(inc: httpx.AsyncClient) -> None:
    body = {"input_ids": PROMPT, "sampling_params": greedy(6), "return_logprob": True, "top_logprobs_num": 2}
    evs = await events(inc, body)
    whole = (await inc.post("/generate", json=body)).json()
    check_deltas(evs, whole, top=2)
    assert all("index" not in e for e in evs)


async def test_several_sequences_each_get_their_deltas(inc: httpx.AsyncClient) -> None:
    prompts = [PROMPT, PROMPT[:4]]
    body = {"input_ids": prompts, "sampling_params": greedy(5), "return_logprob": True}
    evs = await events(inc, body)
    wholes = (await inc.post("/generate", json=body)).json()
    by_index = {
        i: list(g)
        for i, g in itertools.groupby(sorted(evs, key=lambda e: e["index"]), key=lambda e: e["index"])
    }
    assert sorted(by_index) == [0, 1]
    for i, whole in enumerate(wholes):
        check_deltas(by_index[i], whole)
