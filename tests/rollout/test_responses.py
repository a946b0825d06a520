"""``/v1/responses`` on the OpenAI-compatible endpoint, driven by the official ``openai`` SDK
(``client.responses.create``, streamed and not): a function-call round trip that is one token-exact
sequence (the second request's prompt ids extend the first's prompt and output ids), whether the
agent sends the items back or names ``previous_response_id``; the SDK's stream events, argument
deltas included; what is not served is refused with a 400 that names it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.rollout.chat import continuation_ids, prompt_ids
from nodes.rollout.openai_endpoint import ChatEndpoint
from tests.rollout.test_openai_endpoint import CALL, Scripted, sdk

TOOLS = [
    {
        "type": "function",
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    }
]
# the same tool as chat completions (and so the chat template) see it
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_tiny_checkpoint()), local_files_only=True)


@pytest.fixture
async def endpoint(tokenizer: Any) -> AsyncIterator[tuple[ChatEndpoint, Scripted]]:
    gen = Scripted(tokenizer, [])
    ep = ChatEndpoint(gen, tokenizer, "tiny")
    await ep.start()
    try:
        yield ep, gen
    finally:
        await ep.aclose()


def out_ids(tok: Any, text: str) -> list[int]:
    return [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]


@pytest.mark.parametrize("chained", [False, True], ids=["items-sent-back", "previous_response_id"])
async def test_a_function_call_round_trip_is_one_token_exact_sequence(
    endpoint: tuple[ChatEndpoint, Scripted],
    tokenizer: Any,
    chained: bool,
) -> None:
    ep, gen = endpoint
    gen.script = [f"Let me add. {CALL}", "The answer is 5."]
    episode, url = ep.open_episode()
    client = sdk(url)
    r1 = await client.responses.create(model="tiny", instructions="Use tools.", input="2+3?", tools=TOOLS)
    assert r1.status == "completed" and r1.id.startswith("resp_")
    text, call = r1.output
    assert (
        text.type == "message" and text.content[0].text == "Let me add." and r1.output_text == "Let me add."
    )
    assert (
        call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
    )
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    if chained:  # the stored response stands before the new input
        r2 = await client.responses.create(
            model="tiny", instructions="Use tools.", input=[result], tools=TOOLS, previous_response_id=r1.id
        )
    else:  # the agent sends its history back, the response's items included, as the Agents SDK does
        items: list[Any] = [{"role": "user", "content": "2+3?"}, *(o.model_dump() for o in r1.output), result]
        r2 = await client.responses.create(model="tiny", instructions="Use tools.", input=items, tools=TOOLS)
    assert r2.output_text == "The answer is 5." and r2.usage.output_tokens == len(
        out_ids(tokenizer, "The answer is 5.")
    )

    first, second = gen.requests
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+3?"}]
    assert first.input_ids == prompt_ids(tokenizer, messages, CHAT_TOOLS)
    out1 = out_ids(tokenizer, f"Let me add. {CALL}")
    new = continuation_ids(
        tokenizer,
        messages,
        [{"role": "tool", "tool_call_id": call.call_id, "content": "5"}],
        CHAT_TOOLS,
        out1,
        "stop",
    )
    assert second.input_ids == first.input_ids + out1 + new  # the output never re-tokenised
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(new)
    (sample,) = episode.samples
    out2 = out_ids(tokenizer, "The answer is 5.")
    mask = [0] * len(first.input_ids) + [1] * len(out1) + [0] * len(new) + [1] * len(out2)
    assert sample.mask.tolist() == mask
    assert episode.counters == {"calls": 2, "continued": 1, "new_samples": 1, "tool_calls": 1, "errors": 0}


async def test_streamed_events_are_the_sdks_and_the_stream_continues_token_exact(
    endpoint: tuple[ChatEndpoint, Scripted],
    tokenizer: Any,
) -> None:
    ep, gen = endpoint
    gen.streams = True  # tokens reach the endpoint one by one, as from SGLang
    gen.script = [f"Let me add. {CALL}", "It is 5."]
    episode, url = ep.open_episode()
    client = sdk(url)
    events = [
        e async for e in await client.responses.create(input="2+3?", model="tiny", tools=TOOLS, stream=True)
    ]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Let me add." and sum(k == "response.output_text.delta" for k in kinds) > 1  # as generated
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"a": 2, "b": 3}
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == args and done.name == "add"
    final = events[-1].response
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert [o.id for o in final.output] == added and [o.type for o in final.output] == [
        "message",
        "function_call",
    ]
    call = final.output[1]
    items = [
        {"role": "user", "content": "2+3?"},
        *(o.model_dump() for o in final.output),
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
    ]
    stream = await client.responses.create(input=items, model="tiny", tools=TOOLS, stream=True)
    last = [e async for e in stream][-1]
    assert last.response.output_text == "It is 5."
    first, second = gen.requests
    assert second.input_ids[: len(first.input_ids) + len(out_ids(tokenizer, f"Let me add. {CALL}"))] == (
        first.input_ids + out_ids(tokenizer, f"Let me add. {CALL}")
    )
    assert len(episode.samples) == 1 and episode.counters["continued"] == 1


async def test_settings_reach_the_generation(
    endpoint: tuple[ChatEndpoint, Scripted],
) -> None:
    ep, gen = endpoint
    _, url = ep.open_episode()
    r = await sdk(url).responses.create(
        input="Hi", model="tiny", max_output_tokens=7, temperature=0.3, top_p=0.9
    )
    assert gen.requests[0].sampling_params == {"max_new_tokens": 7, "temperature": 0.3, "top_p": 0.9}
    assert r.status == "completed" and r.output_text == "ok"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]},
            "input[0].type",
            "'reasoning' item",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search' tool"),
        (
            {"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]},
            "tools[0].type",
            "file_search",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content",
            "'input_image' part",
        ),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "reasoning is not served"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text", "only plain text"),
        ({"input": "x", "background": True}, "background", "'background' is not served"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id", "no stored response"),
        ({"input": "x", "temperature": 5}, "temperature", "a number in [0.0, 2.0]"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "required (with tools)"),
    ],
)
async def test_what_is_not_served_is_refused_by_name(
    endpoint: tuple[ChatEndpoint, Scripted], body: dict[str, Any], param: str, words: str
) -> None:
    ep, gen = endpoint
    _, url = ep.open_episode()
    with pytest.raises(openai.BadRequestError) as e:
        await sdk(url).responses.create(model="tiny", **body)
    assert e.value.status_code == 400 and words in e.value.body["message"] and e.value.body["param"] == param
    assert not gen.requests  # nothing generated


async def test_store_false_keeps_nothing_and_episodes_do_not_share_responses(
    endpoint: tuple[ChatEndpoint, Scripted],
) -> None:
    ep, _ = endpoint
    a, url_a = ep.open_episode()
    _, url_b = ep.open_episode()
    r = await sdk(url_a).responses.create(input="Hi", model="tiny")
    unstored = await sdk(url_a).responses.create(input="Hi", model="tiny", store=False)
    assert list(a.responses) == [r.id]
    for url, rid in ((url_b, r.id), (url_a, unstored.id)):
        with pytest.raises(openai.BadRequestError, match="no stored response"):
            await sdk(url).responses.create(input="more", model="tiny", previous_response_id=rid)


async def test_the_standalone_v1_serves_responses_and_continues_them(
    endpoint: tuple[ChatEndpoint, Scripted],
) -> None:
    ep, gen = endpoint
    gen.script = ["Hello.", "Again."]
    client = sdk(ep.url + "/v1")  # the standalone server's one episode
    r1 = await client.responses.create(model="tiny", input="Hi")
    r2 = await client.responses.create(model="tiny", input="More", previous_response_id=r1.id)
    assert (r1.output_text, r2.output_text) == ("Hello.", "Again.")
    first, second = gen.requests
    assert (
        second.input_ids[: len(first.input_ids)] == first.input_ids and ep.default.counters["continued"] == 1
    )
