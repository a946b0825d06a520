"""The OpenAI-compatible endpoint driven by the official ``openai`` SDK: chat, tool calls, logprobs,
streaming, n > 1, errors, token-exact continuation, 64 concurrent episodes; then in front of a real
reference server through the rollout client, with an abort and resume mid-turn."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.rollout import turns
from nodes.rollout.chat import continuation_ids, prompt_ids
from nodes.rollout.client import GenerationError, GenRequest, GenResult, SGLangClient
from nodes.rollout.openai_endpoint import ChatEndpoint
from tests.helpers.servers import wait_decoding

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_tiny_checkpoint()), local_files_only=True)


class Scripted:
    """Stands in for SGLangClient: answers each request with the next scripted text (as ids, then
    the end-of-turn token), log-probs -0.5 - i/100 and versions 7; records every request."""

    def __init__(self, tokenizer: Any, script: list[str]) -> None:
        self.tok, self.script, self.requests = tokenizer, list(script), []

    streams = False  # True: hands each token to GenRequest.on_tokens as it "arrives", as SGLangClient
    matched_stop: str | None = None  # the stop string each scripted text ends with

    async def agenerate(self, request: GenRequest) -> GenResult:
        self.requests.append(request)
        text = self.script.pop(0) if self.script else "ok"
        ids = [*self.tok.encode(text, add_special_tokens=False), self.tok.eos_token_id]
        lps = [-0.5 - i / 100 for i in range(len(ids))]
        tops = [[(lp, t), (lp - 1.0, 42)] for t, lp in zip(ids, lps, strict=True)]
        for i in range(len(ids)) if self.streams and request.on_tokens else ():
            request.on_tokens([ids[i]], [lps[i]], [tops[i]] if request.top_logprobs_num else [])
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)
        finish = "stop"
        res = GenResult(
            request.rid or "",
            ids,
            lps,
            [7] * len(ids),
            finish,
            text,
            len(request.input_ids),
            [0],
            "scripted",
            matched_stop=self.matched_stop,
        )
        if request.top_logprobs_num:
            res.output_top_logprobs = tops
        return res


@pytest.fixture
async def endpoint(tokenizer: Any) -> AsyncIterator[tuple[ChatEndpoint, Scripted]]:
    gen = Scripted(tokenizer, [])
    ep = ChatEndpoint(gen, tokenizer, "tiny")
    await ep.start()
    try:
        yield ep, gen
    finally:
        await ep.aclose()


def sdk(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


async def test_chat_and_models(endpoint: tuple[ChatEndpoint, Scripted]) -> None:
    ep, gen = endpoint
    gen.script = ["Hello there."]
    episode, url = ep.open_episode()
    client = sdk(url)
    r = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=32
    )
    assert r.choices[0].message.content == "Hello there." and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(gen.requests and episode.samples[0].ids) - r.usage.prompt_tokens
    assert gen.requests[0].sampling_params["max_new_tokens"] == 32
    assert [m.id for m in (await client.models.list()).data] == ["tiny"]


async def test_tool_call_round_trip_is_one_token_exact_sequence(
    endpoint: tuple[ChatEndpoint, Scripted], tokenizer: Any
) -> None:
    ep, gen = endpoint
    gen.script = [f"Let me add. {CALL}", "The answer is 5."]
    episode, url = ep.open_episode()
    client = sdk(url)
    messages: list[Any] = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+3?"}]
    r1 = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    m1 = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls" and m1.content == "Let me add."
    (call,) = m1.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    # the agent runs the tool and sends the history back, as any OpenAI agent does
    messages += [m1.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r2 = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    assert r2.choices[0].message.content == "The answer is 5." and r2.choices[0].finish_reason == "stop"

    first, second = gen.requests
    out1 = [*tokenizer.encode(f"Let me add. {CALL}", add_special_tokens=False), tokenizer.eos_token_id]
    new = continuation_ids(tokenizer, messages[:2], messages[3:], TOOLS, out1, "stop")
    assert first.input_ids == prompt_ids(
        tokenizer, messages[:2], TOOLS
    )  # Hermes preamble: SmolLM2 has no tools
    assert second.input_ids == first.input_ids + out1 + new  # never re-tokenised
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(new)
    (sample,) = episode.samples
    out2 = [*tokenizer.encode("The answer is 5.", add_special_tokens=False), tokenizer.eos_token_id]
    assert sample.ids.tolist() == second.input_ids + out2
    mask = [0] * len(first.input_ids) + [1] * len(out1) + [0] * len(new) + [1] * len(out2)
    assert sample.mask.tolist() == mask
    assert sample.versions[sample.mask == 1].tolist() == [7] * (len(out1) + len(out2))
    assert episode.counters == {"calls": 2, "continued": 1, "new_samples": 1, "tool_calls": 1, "errors": 0}


async def test_a_first_prompt_is_rendered_once_per_messages_and_tools(
    endpoint: tuple[ChatEndpoint, Scripted], tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GRPO group's episodes open with the same messages: the template and tokenizer run once
    for them, and every episode still gets a sample of its own with the exact ids."""
    ep, gen = endpoint
    rendered: list[Any] = []
    monkeypatch.setattr(turns, "prompt_ids", lambda *a: rendered.append(a[1:]) or prompt_ids(*a))
    same = [{"role": "user", "content": "same"}]
    episodes = [ep.open_episode() for _ in range(3)]
    for _, url in episodes:
        await sdk(url).chat.completions.create(model="tiny", messages=same)
    await sdk(episodes[0][1]).chat.completions.create(model="tiny", messages=same, tools=TOOLS)
    assert rendered == [(same, None), (same, TOOLS)]
    assert [r.input_ids for r in gen.requests[:3]] == [prompt_ids(tokenizer, same, None)] * 3
    assert gen.requests[3].input_ids == prompt_ids(tokenizer, same, TOOLS)
    assert [len(e.samples) for e, _ in episodes] == [2, 1, 1]
    monkeypatch.setattr(turns, "FIRST_PROMPTS_KEPT", 2)  # the oldest kept prompt goes first
    for text in ("other", "same"):
        await sdk(episodes[0][1]).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": text}]
        )
    assert rendered[2:] == [([{"role": "user", "content": "other"}], None), (same, None)]
    assert gen.requests[-1].input_ids == prompt_ids(tokenizer, same, None)


async def test_edited_history_starts_another_sample(endpoint: tuple[ChatEndpoint, Scripted]) -> None:
    ep, gen = endpoint
    gen.script = ["one", "two"]
    episode, url = ep.open_episode()
    client = sdk(url)
    r1 = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}])
    edited = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "ONE (edited)"},
        {"role": "user", "content": "b"},
    ]
    await client.chat.completions.create(model="tiny", messages=edited)
    assert r1.choices[0].message.content == "one"
    assert (
        len(episode.samples) == 2
        and episode.counters["new_samples"] == 2
        and episode.counters["continued"] == 0
    )


async def test_logprobs_per_token_with_top_logprobs(
    endpoint: tuple[ChatEndpoint, Scripted], tokenizer: Any
) -> None:
    ep, gen = endpoint
    gen.script = ["abc def"]
    _, url = ep.open_episode()
    r = await sdk(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2
    )
    lps = r.choices[0].logprobs.content
    ids = [*tokenizer.encode("abc def", add_special_tokens=False), tokenizer.eos_token_id]
    assert [e.logprob for e in lps] == pytest.approx([-0.5 - i / 100 for i in range(len(ids))])
    assert [e.token for e in lps] == [tokenizer.decode([t]) for t in ids]
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in lps)
    assert gen.requests[0].top_logprobs_num == 2


async def test_streaming_with_tool_call_deltas(endpoint: tuple[ChatEndpoint, Scripted]) -> None:
    ep, gen = endpoint
    gen.script = [f"Sure. {CALL}"]
    _, url = ep.open_episode()
    stream = await sdk(url).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "2+3"}],
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, calls, finish, usage, chunks = "", {}, None, None, 0
    async for chunk in stream:
        chunks += 1
        usage = chunk.usage or usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or ():
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = d.id or c["id"]
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    assert content == "Sure." and finish == "tool_calls" and chunks > 4
    assert (
        calls[0]["name"] == "add" and json.loads(calls[0]["arguments"]) == {"a": 2, "b": 3} and calls[0]["id"]
    )
    assert usage is not None and usage.completion_tokens > 0


async def read_stream(stream: Any, episode: Any = None) -> dict[str, Any]:
    """A streamed answer as an agent reads it: content per choice, tool calls, finish reasons, log-prob
    entries; ``generating``: how many content chunks came while ``episode`` had no output yet."""
    out: dict[str, Any] = {
        "content": {},
        "calls": {},
        "finish": {},
        "logprobs": [],
        "generating": 0,
        "pieces": [],
    }
    async for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.content:
                out["pieces"].append(ch.delta.content)
                if episode is not None and not any(m for s in episode.samples for m in s.mask):
                    out["generating"] += 1
            out["content"][ch.index] = out["content"].get(ch.index, "") + (ch.delta.content or "")
            out["logprobs"] += ch.logprobs.content if ch.logprobs and ch.logprobs.content else []
            for d in ch.delta.tool_calls or ():
                c = out["calls"].setdefault(d.index, {"name": "", "arguments": ""})
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
            if ch.finish_reason:
                out["finish"][ch.index] = ch.finish_reason
    return out


async def test_content_streams_as_generated_and_a_tool_call_is_held_back(
    endpoint: tuple[ChatEndpoint, Scripted], tokenizer: Any
) -> None:
    ep, gen = endpoint
    gen.streams = True
    gen.script = [f"Let me add these. {CALL}"]
    episode, url = ep.open_episode()
    stream = await sdk(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "2+3"}], tools=TOOLS, stream=True, logprobs=True
    )
    got = await read_stream(stream, episode)
    assert got["content"] == {0: "Let me add these."} and got["finish"] == {0: "tool_calls"}
    assert got["generating"] >= 3  # content went out token by token while the model generated
    assert not any("<" in p for p in got["pieces"])  # the call's opening never shows as content
    assert json.loads(got["calls"][0]["arguments"]) == {"a": 2, "b": 3}
    ids = [*tokenizer.encode(f"Let me add these. {CALL}", add_special_tokens=False), tokenizer.eos_token_id]
    assert [e.logprob for e in got["logprobs"]] == pytest.approx([-0.5 - i / 100 for i in range(len(ids))])


class FailsMidStream(Scripted):
    """Streams two tokens, then the generation fails (every server gone)."""

    async def agenerate(self, request: GenRequest) -> GenResult:
        self.requests.append(request)
        if request.on_tokens is not None:
            request.on_tokens([self.tok.encode("a", add_special_tokens=False)[0]], [-0.1], [])
        await asyncio.sleep(0.05)
        raise GenerationError("every server failed")


async def test_a_generation_that_fails_mid_stream_ends_it_with_an_error_and_the_endpoint_serves_on(
    tokenizer: Any,
) -> None:
    ep = ChatEndpoint(FailsMidStream(tokenizer, []), tokenizer, "tiny")
    await ep.start()
    try:
        episode, url = ep.open_episode()
        stream = await sdk(url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], stream=True
        )
        with pytest.raises(openai.APIError, match="generation failed: every server failed"):
            await read_stream(stream)
        assert episode.counters["errors"] == 1
        ep.client = Scripted(tokenizer, ["fine"])
        r = await sdk(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y"}])
        assert r.choices[0].message.content == "fine"
    finally:
        await ep.aclose()


async def test_a_stop_string_never_streams(endpoint: tuple[ChatEndpoint, Scripted]) -> None:
    ep, gen = endpoint
    gen.streams, gen.matched_stop = True, "STOP"
    gen.script = ["one two three STOP"]
    _, url = ep.open_episode()
    stream = await sdk(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], stop=["STOP"], stream=True
    )
    got = await read_stream(stream)
    assert got["content"] == {0: "one two three "} and "S" not in "".join(got["pieces"][:-1])
    assert len(got["pieces"]) > 2


async def test_n_choices_are_samples_of_their_own(endpoint: tuple[ChatEndpoint, Scripted]) -> None:
    ep, gen = endpoint
    gen.script = ["first", "second", "third"]
    episode, url = ep.open_episode()
    r = await sdk(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=3)
    assert sorted(c.message.content for c in r.choices) == ["first", "second", "third"]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len(episode.samples) == 3 and len({req.rid for req in gen.requests}) == 3  # one rid per sample


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "5"}]}, "messages[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content",
        ),
    ],
)
async def test_malformed_requests_are_openai_errors_and_the_endpoint_serves_on(
    endpoint: tuple[ChatEndpoint, Scripted], kwargs: dict[str, Any], param: str
) -> None:
    ep, gen = endpoint
    _, url = ep.open_episode()
    client = sdk(url)
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="tiny", **kwargs)
    assert (
        e.value.status_code == 400
        and e.value.body["param"] == param
        and e.value.body["type"] == "invalid_request_error"
    )
    gen.script = ["still here"]
    r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content == "still here"


async def test_bad_json_unknown_episode_and_route(endpoint: tuple[ChatEndpoint, Scripted]) -> None:
    ep, _ = endpoint
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{ep.url}/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = await http.get(f"{ep.url}/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        await sdk(f"{ep.url}/episodes/nope/v1").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}]
        )


async def test_64_concurrent_episodes(endpoint: tuple[ChatEndpoint, Scripted]) -> None:
    ep, gen = endpoint
    gen.script = [f"answer {i}" for i in range(128)]

    async def episode(i: int) -> tuple[Any, int]:
        record, url = ep.open_episode(f"e{i}")
        client = sdk(url)
        msgs: list[Any] = [{"role": "user", "content": f"q{i}"}]
        r = await client.chat.completions.create(model="tiny", messages=msgs)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="tiny", messages=msgs)
        return ep.close_episode(record.id), i

    done = await asyncio.gather(*(episode(i) for i in range(64)))
    assert all(len(rec.samples) == 1 and rec.counters["continued"] == 1 for rec, _ in done)
    assert not ep.episodes


# -- in front of a real reference server, through the rollout client --------------------------


@contextlib.asynccontextmanager
async def sim_endpoint(slow_sim: str, tokenizer: Any) -> AsyncIterator[tuple[SGLangClient, ChatEndpoint]]:
    """The endpoint in front of ``slow_sim`` through a real rollout client."""
    client = SGLangClient([slow_sim])
    ep = ChatEndpoint(client, tokenizer, "sim")
    await ep.start()
    try:
        yield client, ep
    finally:
        await ep.aclose()
        await client.aclose()


async def pause_mid_request(slow_sim: str, client: SGLangClient) -> None:
    """Once the server decodes, pause it (abort mode) and resume, as PolicySync does for a weight update."""
    async with httpx.AsyncClient(base_url=slow_sim) as http:
        await wait_decoding(http)  # a few steps in
        client.pause()
        assert (await http.post("/pause_generation", json={"mode": "abort"})).status_code == 200
        client.resume()
        await http.post("/continue_generation", json={})


async def test_abort_and_resume_mid_turn_is_invisible_to_agent_and_trajectory(
    slow_sim: str, tokenizer: Any
) -> None:
    async with sim_endpoint(slow_sim, tokenizer) as (client, ep):
        episode, url = ep.open_episode()
        agent = asyncio.ensure_future(
            sdk(url).chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=40
            )
        )
        await pause_mid_request(slow_sim, client)
        r = await agent
        (sample,) = episode.samples
        out = [t for t, m in zip(sample.ids, sample.mask, strict=True) if m]
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40 == len(out)
        assert sample.meta["aborts"] >= 1  # it was cut off and resumed on the server's cache
        assert r.choices[0].message.content == tokenizer.decode(out, skip_special_tokens=True)


async def test_a_stream_from_a_real_server_arrives_while_it_generates_and_survives_a_resume(
    slow_sim: str, tokenizer: Any
) -> None:
    async with sim_endpoint(slow_sim, tokenizer) as (client, ep):
        episode, url = ep.open_episode()

        async def agent() -> dict[str, Any]:
            stream = await sdk(url).chat.completions.create(
                model="sim",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=40,
                stream=True,
                logprobs=True,
                stream_options={"include_usage": True},
            )
            return await read_stream(stream, episode)

        task = asyncio.ensure_future(agent())
        await pause_mid_request(slow_sim, client)
        got = await task
        (sample,) = episode.samples
        out = [t for t, m in zip(sample.ids, sample.mask, strict=True) if m]
        assert sample.meta["aborts"] >= 1 and len(out) == 40 and got["finish"] == {0: "length"}
        assert got["generating"] >= 2  # content chunks came before the answer was complete
        assert got["content"][0] == tokenizer.decode(out, skip_special_tokens=True)
        assert len(got["logprobs"]) == 40  # one entry per token, none twice across the resume
        assert [e.logprob for e in got["logprobs"]] == pytest.approx(
            [lp for lp, m in zip(sample.logprobs, sample.mask, strict=True) if m]
        )


async def test_the_standalone_episode_keeps_no_samples_but_still_continues(
    endpoint: tuple[ChatEndpoint, Scripted],
) -> None:
    ep, gen = endpoint
    gen.script = ["one", "two"]
    client = sdk(f"{ep.url}/v1")  # the standalone server's base_url: one episode, nobody collects it
    msgs: list[Any] = [{"role": "user", "content": "a"}]
    r = await client.chat.completions.create(model="tiny", messages=msgs)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "b"}]
    await client.chat.completions.create(model="tiny", messages=msgs)
    assert ep.default.samples == [] and ep.default.counters["continued"] == 1  # memory stays flat
    first, second = gen.requests
    assert second.input_ids[: len(first.input_ids)] == first.input_ids and second.rid == first.rid


def bracket_calls(text: str) -> tuple[str | None, list[Any]]:
    """A parser of one's own: ``CALL name {json}``."""
    from nodes.rollout.chat import ToolCall

    head, _, call = text.partition("CALL ")
    if not call:
        return text, []
    name, _, args = call.partition(" ")
    return head.strip() or None, [ToolCall("call_1", name, args.strip())]


async def test_the_tool_parser_is_selectable(tokenizer: Any) -> None:
    from nodes.rollout.chat import parse_tool_calls, tool_parser

    assert tool_parser("hermes") is tool_parser("qwen25") is parse_tool_calls
    with pytest.raises(ValueError, match="use hermes or qwen25"):
        tool_parser("mistral")
    gen = Scripted(tokenizer, ['CALL add {"a": 2, "b": 3}'])
    ep = ChatEndpoint(gen, tokenizer, "tiny", tool_parser="tests.rollout.test_openai_endpoint:bracket_calls")
    await ep.start()
    try:
        _, url = ep.open_episode()
        r = await sdk(url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], tools=TOOLS
        )
        (call,) = r.choices[0].message.tool_calls
        assert (call.function.name, call.function.arguments) == ("add", '{"a": 2, "b": 3}')
        assert r.choices[0].finish_reason == "tool_calls"
    finally:
        await ep.aclose()


async def test_long_conversations_render_off_the_loop_short_ones_on_it(
    endpoint: tuple[ChatEndpoint, Scripted], tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to INLINE_RENDER_CHARS of new messages render on the loop (a thread hop cost more than the
    rendering); longer ones in a thread. Either way the ids are prompt_ids' and continuation_ids'."""
    hops: list[str] = []
    to_thread = asyncio.to_thread

    async def counted(fn: Any, *args: Any) -> Any:
        hops.append(fn.__name__)  # the endpoint's, and the openai SDK's (it asks for the platform)
        return await to_thread(fn, *args)

    monkeypatch.setattr(turns.asyncio, "to_thread", counted)
    ep, gen = endpoint
    long = "x " * turns.INLINE_RENDER_CHARS
    _, url = ep.open_episode()
    client = sdk(url)
    for system, result in (("Use tools.", "5"), ("Use tools.", long), (long, "5")):
        gen.script = [f"Let me add. {CALL}", "Done."]
        messages: list[Any] = [{"role": "system", "content": system}, {"role": "user", "content": "2+3?"}]
        r1 = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
        m1 = r1.choices[0].message
        messages += [
            m1.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": result},
        ]
        await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
        first, second = gen.requests[-2:]
        out1 = [*tokenizer.encode(m1.content + " " + CALL, add_special_tokens=False), tokenizer.eos_token_id]
        assert first.input_ids == prompt_ids(tokenizer, messages[:2], TOOLS)
        assert second.input_ids == first.input_ids + out1 + continuation_ids(
            tokenizer, messages[:2], messages[3:], TOOLS, out1, "stop"
        )
    # short first turn and short result: on the loop; the long result: its continuation in a
    # thread; the long system prompt: the first render in a thread, its short result on the loop
    assert [h for h in hops if h in ("prompt_ids", "continuation_ids")] == ["continuation_ids", "prompt_ids"]
