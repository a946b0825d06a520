"""Streamed generation (``GenRequest.on_tokens``): every token handed over once, in order, as it
arrives, across SGLang's two stream shapes, aborts and resumes, a stream cut short, error events;
first against scripted answers, then against a reference server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from nodes.rollout.client import ClientConfig, GenerationError, GenRequest, SGLangClient
from rlactors.base.aio import wait_for
from tests.helpers.servers import reference_server, wait_decoding
from tests.rollout.scripted import Script, Serve, reply, sse
from tests.rollout.test_client_mock import FAST


def events(chunks: list[list[int]], finish: str | None = "length", incremental: bool = False) -> list[bytes]:
    """SGLang's event stream of an output arriving in ``chunks``: the whole output so far in each
    event (its default), or only what is new (``--incremental-streaming-output``); the last event
    carries ``finish`` (None: the stream stops short, without one)."""
    out, ids = [], []
    for k, chunk in enumerate(chunks):
        ids += chunk
        shown = chunk if incremental else ids
        meta: dict[str, Any] = {
            "finish_reason": {"type": finish} if finish and k == len(chunks) - 1 else None,
            "completion_tokens": len(ids),
            "output_token_logprobs": [[-0.1 * t, t, None] for t in shown],
        }
        text = "".join(chr(97 + t % 26) for t in shown)
        out.append(b"data: " + orjson.dumps({"output_ids": shown, "text": text, "meta_info": meta}) + b"\n\n")
    return [*out, b"data: [DONE]\n\n"] if finish else out


class Tokens:
    """What ``on_tokens`` got: every call's ids, log-probs."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.lps: list[float] = []
        self.first = asyncio.Event()  # set at the first call

    def __call__(self, ids: list[int], lps: list[float], tops: list[Any]) -> None:
        self.calls.append(list(ids))
        self.lps += lps
        self.first.set()

    @property
    def ids(self) -> list[int]:
        return [t for c in self.calls for t in c]


@pytest.mark.parametrize("incremental", [False, True], ids=["whole-output-events", "incremental-events"])
async def test_each_token_is_handed_over_once_as_it_arrives(serve: Serve, incremental: bool) -> None:
    # the empty chunk: an event that repeats the last (real SGLang sends one when a step adds nothing)
    script = Script(a=[lambda b: sse(events([[5], [], [6, 7], [8]], incremental=incremental))])
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    got = Tokens()
    res = await client.agenerate(GenRequest([1, 2], {"max_new_tokens": 4}, "r", on_tokens=got))
    assert got.calls == [[5], [6, 7], [8]] and res.output_ids == [5, 6, 7, 8]
    assert got.lps == res.output_logprobs == pytest.approx([-0.5, -0.6, -0.7, -0.8])
    assert res.text == "fghi" and res.finish_reason == "length"
    assert script.posts[0][1]["stream"] is True
    await client.aclose()


async def test_a_stream_cut_short_resumes_from_the_tokens_that_came(serve: Serve) -> None:
    script = Script(
        a=[lambda b: sse(events([[5], [6, 7]], finish=None), cut=True), lambda b: sse(events([[8]]))]
    )
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    got = Tokens()
    res = await client.agenerate(GenRequest([1, 2], {"max_new_tokens": 4}, "r", on_tokens=got))
    assert got.ids == res.output_ids == [5, 6, 7, 8]
    _, (_, second) = script.posts
    assert second["input_ids"] == [1, 2, 5, 6, 7] and second["sampling_params"]["max_new_tokens"] == 1
    assert second["rid"] == "r-r1" and res.aborts == 1  # resumed as after an abort, on the same server
    await client.aclose()


async def test_a_stream_that_ends_without_a_finish_is_resumed_too(serve: Serve) -> None:
    script = Script(a=[lambda b: sse(events([[5, 6]], finish=None)), lambda b: sse(events([[7]]))])
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    got = Tokens()
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 3}, "r", on_tokens=got))
    assert got.ids == res.output_ids == [5, 6, 7] and res.aborts == 1 and len(script.posts) == 2
    await client.aclose()


async def test_error_events_before_any_token_read_as_statuses(serve: Serve) -> None:
    def error(code: int) -> Any:
        err = {"error": {"message": "bad", "code": code}}
        return lambda b: sse([b"data: " + orjson.dumps(err) + b"\n\n", b"data: [DONE]\n\n"])

    bad = Script(a=[error(400)])
    [A] = (await serve(bad)).urls
    client = SGLangClient([A], FAST)
    with pytest.raises(GenerationError, match="failed the stream: bad"):
        await client.agenerate(GenRequest([1], {"max_new_tokens": 2}, on_tokens=Tokens()))
    await client.aclose()
    flaky = Script(a=[error(500), lambda b: sse(events([[4, 5]]))])
    [A] = (await serve(flaky)).urls
    client = SGLangClient([A], FAST)
    got = Tokens()
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 2}, on_tokens=got))
    assert got.ids == res.output_ids == [4, 5] and client.counters["retries"] == 1
    await client.aclose()


async def test_a_server_that_answers_whole_hands_the_tokens_over_at_once(serve: Serve) -> None:
    script = Script(a=[lambda b: reply([3, 4, 5])])
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    got = Tokens()
    res = await client.agenerate(GenRequest([1], {"max_new_tokens": 3}, on_tokens=got))
    assert got.calls == [[3, 4, 5]] and res.output_ids == [3, 4, 5]
    await client.aclose()


# -- against a reference server ------------------------------------------------------------------

SLOW = ["--backend", "sim", "--sim-decode-s-base", "0.02", "--sim-eos-prob", "0"]


@pytest.fixture(scope="module", params=[False, True], ids=["whole-output-events", "incremental-events"])
def slow_server(request: pytest.FixtureRequest) -> Iterator[str]:
    with reference_server(SLOW + (["--incremental-streaming-output"] if request.param else [])) as url:
        yield url


async def test_streamed_across_an_abort_and_resume_every_token_once(slow_server: str) -> None:
    client = SGLangClient([slow_server], ClientConfig())
    got = Tokens()
    task = asyncio.ensure_future(
        client.agenerate(
            GenRequest([1, 2, 3], {"max_new_tokens": 40, "temperature": 1.0}, "s", on_tokens=got)
        )
    )
    async with httpx.AsyncClient(base_url=slow_server) as ctl:
        await wait_decoding(ctl)
        await wait_for(got.first.wait(), 30)  # tokens arrive while the request still runs
        assert not task.done()
        client.pause()
        assert (await ctl.post("/pause_generation", json={"mode": "abort"})).status_code == 200
        client.resume()
        await ctl.post("/continue_generation", json={})
    res = await task
    assert res.aborts >= 1 and len(res.output_ids) == 40
    assert got.ids == res.output_ids and got.lps == res.output_logprobs
    assert len(got.calls) > 2  # in pieces, not at the end
    await client.aclose()
