"""``/v1/messages`` (Anthropic's Messages API) on the rollout actor's endpoint, driven by the official
``anthropic`` SDK against scripted model output: a tool_use round trip that is one token-exact
sequence (the second request's prompt ids extend the first's prompt and output ids); the SDK's
stream events and its stream helper's message, the same as the whole answer's; stop reasons and
sampling settings; ``count_tokens``; the key as ``x-api-key``; what is not served refused with
Anthropic's error shape. tests/conformance/test_messages_endpoint.py drives it in front of a real
server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pytest

from nodes.rollout.chat import continuation_ids, prompt_ids
from nodes.rollout.openai_endpoint import ChatEndpoint
from tests.rollout.test_openai_endpoint import CALL, Scripted, sdk
from tests.rollout.test_responses import tokenizer  # noqa: F401 - the fixture

TOOLS = [
    {
        "name": "add",
        "description": "Add two integers.",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    }
]
# the same tool as chat completions (and so the chat template) see it
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": TOOLS[0]["description"],
            "parameters": TOOLS[0]["input_schema"],
        },
    }
]


_clients: list[anthropic.AsyncAnthropic] = []  # closed by the test's endpoint, on its loop


def claude(base_url: str, api_key: str = "unused") -> anthropic.AsyncAnthropic:
    """The Anthropic SDK on an episode's base_url without its ``/v1`` (the SDK adds ``/v1/messages``)."""
    client = anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    _clients.append(client)
    return client


@pytest.fixture
async def endpoint(tokenizer: Any) -> AsyncIterator[tuple[ChatEndpoint, Scripted]]:  # noqa: F811
    gen = Scripted(tokenizer, [])
    ep = ChatEndpoint(gen, tokenizer, "tiny")
    await ep.start()
    try:
        yield ep, gen
    finally:
        await close_clients()
        await ep.aclose()


async def close_clients() -> None:
    while _clients:
        await _clients.pop().close()


def without_ids(message: Any) -> dict[str, Any]:
    """A message as a dict, its id and its tool calls' ids left out (each answer has its own)."""
    d = message.model_dump(exclude={"id"})
    for block in d["content"]:
        block.pop("id", None)
    return d


def out_ids(tok: Any, text: str) -> list[int]:
    return [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]


async def test_a_tool_use_round_trip_is_one_token_exact_sequence(
    endpoint: tuple[ChatEndpoint, Scripted],
    tokenizer: Any,  # noqa: F811
) -> None:
    ep, gen = endpoint
    gen.script = [f"Let me add. {CALL}", "The answer is 5."]
    episode, url = ep.open_episode()
    client = claude(url)
    messages: list[Any] = [{"role": "user", "content": "2+3?"}]
    m1 = await client.messages.create(
        model="tiny", max_tokens=64, system="Use tools.", messages=messages, tools=TOOLS
    )  # type: ignore[arg-type]
    assert m1.type == "message" and m1.role == "assistant" and m1.id.startswith("msg_")
    assert m1.stop_reason == "tool_use" and m1.stop_sequence is None
    text, use = m1.content
    assert text.type == "text" and text.text == "Let me add."
    assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 2, "b": 3}
    out1 = out_ids(tokenizer, f"Let me add. {CALL}")
    assert m1.usage.output_tokens == len(out1)
    # the agent runs the tool and sends the history back, as Anthropic's tool-use guide does
    messages += [
        {"role": "assistant", "content": m1.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
    ]
    m2 = await client.messages.create(
        model="tiny", max_tokens=64, system="Use tools.", messages=messages, tools=TOOLS
    )  # type: ignore[arg-type]
    assert m2.stop_reason == "end_turn" and [b.text for b in m2.content] == ["The answer is 5."]  # type: ignore[union-attr]

    first, second = gen.requests
    chat = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+3?"}]
    assert first.input_ids == prompt_ids(tokenizer, chat, CHAT_TOOLS) and m1.usage.input_tokens == len(
        first.input_ids
    )
    new = continuation_ids(
        tokenizer, chat, [{"role": "tool", "tool_call_id": use.id, "content": "5"}], CHAT_TOOLS, out1, "stop"
    )
    assert second.input_ids == first.input_ids + out1 + new  # the output never re-tokenised
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(new)
    (sample,) = episode.samples
    out2 = out_ids(tokenizer, "The answer is 5.")
    assert sample.ids.tolist() == second.input_ids + out2
    assert sample.mask.tolist() == [0] * len(first.input_ids) + [1] * len(out1) + [0] * len(new) + [1] * len(
        out2
    )
    assert episode.counters == {"calls": 2, "continued": 1, "new_samples": 1, "tool_calls": 1, "errors": 0}


async def test_the_stream_is_the_sdks_events_and_its_message_the_whole_answers(
    endpoint: tuple[ChatEndpoint, Scripted],
    tokenizer: Any,  # noqa: F811
) -> None:
    ep, gen = endpoint
    gen.streams = True  # tokens reach the endpoint one by one, as from SGLang
    gen.script = [f"Let me add. {CALL}", f"Let me add. {CALL}", "It is 5."]
    episode, url = ep.open_episode()
    client = claude(url)
    ask: dict[str, Any] = {"model": "tiny", "max_tokens": 64, "tools": TOOLS}
    whole = await client.messages.create(messages=[{"role": "user", "content": "2+3?"}], **ask)
    async with client.messages.stream(messages=[{"role": "user", "content": "2+3?"}], **ask) as stream:
        events = [e async for e in stream]
        streamed = await stream.get_final_message()
    kinds = [e.type for e in events]
    texts = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    raw = [k for k in kinds if k not in ("text", "input_json")]  # the helper's own events beside the SDK's
    assert raw == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * len(texts),
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(texts) == "Let me add." and len(texts) > 1  # as generated, token by token
    assert without_ids(streamed) == without_ids(whole)
    assert streamed.content[1].input == {"a": 2, "b": 3} and streamed.stop_reason == "tool_use"  # type: ignore[union-attr]
    # the streamed message sent back continues its own sample, token-exact
    use = streamed.content[1]
    followup = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": streamed.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
    ]  # type: ignore[union-attr]
    async with client.messages.stream(messages=followup, **ask) as stream:
        assert await stream.get_final_text() == "It is 5."
    _, second, third = gen.requests
    out = out_ids(tokenizer, f"Let me add. {CALL}")
    assert third.input_ids[: len(second.input_ids) + len(out)] == second.input_ids + out
    assert len(episode.samples) == 2 and episode.counters["continued"] == 1


async def test_with_tools_a_text_starting_with_whitespace_streams_as_read(
    endpoint: tuple[ChatEndpoint, Scripted],
) -> None:
    """The tool-call parser strips the text before a call; the stream's deltas add up to that text."""
    ep, gen = endpoint
    gen.streams = True
    gen.script = [f"  Let me add. {CALL}", "  no call here"]
    _, url = ep.open_episode()
    client = claude(url)
    for want in (["Let me add.", {"a": 2, "b": 3}], ["  no call here"]):
        async with client.messages.stream(
            model="tiny",
            max_tokens=64,
            tools=TOOLS,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "2+3?"}],
        ) as stream:
            msg = await stream.get_final_message()
        assert [getattr(b, "text", None) or getattr(b, "input", None) for b in msg.content] == want


async def test_stop_reasons_and_settings_reach_the_generation(
    endpoint: tuple[ChatEndpoint, Scripted],
) -> None:
    ep, gen = endpoint
    gen.script = ["Hello END", "cut"]
    gen.matched_stop = "END"
    _, url = ep.open_episode()
    client = claude(url)
    # the current SDK takes no sampling settings of its own: they go in its extra_body
    # (metadata and an adaptive thinking, which this model never does, are accepted and change nothing)
    m = await client.messages.create(
        model="tiny",
        max_tokens=7,
        stop_sequences=["END"],
        metadata={"user_id": "u"},
        thinking={"type": "adaptive"},
        extra_body={"temperature": 0.3, "top_p": 0.9, "top_k": 5},
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert gen.requests[0].sampling_params == {
        "max_new_tokens": 7,
        "temperature": 0.3,
        "top_p": 0.9,
        "top_k": 5,
        "stop": ["END"],
    }
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "END", "Hello ")  # type: ignore[union-attr]
    gen.matched_stop = None

    class Cut(Scripted):
        async def agenerate(self, request: Any) -> Any:
            res = await super().agenerate(request)
            res.finish_reason = "length"
            return res

    ep.client = Cut(gen.tok, ["cut"])
    m = await claude(ep.url + "/v1").messages.create(
        model="tiny", max_tokens=3, messages=[{"role": "user", "content": "Hi"}]
    )
    assert m.stop_reason == "max_tokens" and m.content[0].text == "cut"  # type: ignore[union-attr]


async def test_a_call_whose_arguments_are_not_an_object_is_sent_back_as_served(
    endpoint: tuple[ChatEndpoint, Scripted],
) -> None:
    """``tool_use.input`` must be an object: a malformed call's is ``{}``, and sent back it is the
    served call again (the sequence continues)."""
    ep, gen = endpoint
    gen.script = ['<tool_call>\n{"name": "add", "arguments": "two and three"}\n</tool_call>', "ok"]
    episode, url = ep.open_episode()
    client = claude(url)
    messages: list[Any] = [{"role": "user", "content": "2+3?"}]
    m1 = await client.messages.create(model="tiny", max_tokens=64, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    (use,) = m1.content
    assert use.type == "tool_use" and use.input == {}
    messages += [
        {"role": "assistant", "content": m1.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "?"}]},
    ]
    await client.messages.create(model="tiny", max_tokens=64, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert episode.counters["continued"] == 1 and len(episode.samples) == 1


async def test_count_tokens_is_the_rendered_prompts(
    endpoint: tuple[ChatEndpoint, Scripted],
    tokenizer: Any,  # noqa: F811
) -> None:
    ep, gen = endpoint
    _, url = ep.open_episode()
    messages: list[Any] = [{"role": "user", "content": "2+3?"}]
    got = await claude(url).messages.count_tokens(
        model="tiny", system="Use tools.", messages=messages, tools=TOOLS
    )  # type: ignore[arg-type]
    chat = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+3?"}]
    assert got.input_tokens == len(prompt_ids(tokenizer, chat, CHAT_TOOLS))
    bare = await claude(url).messages.count_tokens(model="tiny", messages=messages)
    assert bare.input_tokens == len(prompt_ids(tokenizer, chat[1:], None)) and not gen.requests


async def test_the_key_is_accepted_as_x_api_key_and_a_wrong_one_refused_in_anthropics_shape(
    tokenizer: Any,  # noqa: F811
) -> None:
    ep = ChatEndpoint(Scripted(tokenizer, ["ok", "ok"]), tokenizer, "tiny", api_key="sekret")
    await ep.start()
    try:
        m = await claude(ep.url + "/v1", "sekret").messages.create(
            model="tiny", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
        )
        assert m.content[0].text == "ok"  # type: ignore[union-attr]
        with pytest.raises(anthropic.AuthenticationError) as e:
            await claude(ep.url + "/v1", "wrong").messages.create(
                model="tiny", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
            )
        assert e.value.status_code == 401 and e.value.body["type"] == "error"  # type: ignore[index]
        assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        # the OpenAI SDK's bearer key still works beside it, its errors still OpenAI's shape
        r = (
            await sdk(ep.url + "/v1")
            .with_options(api_key="sekret")
            .chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
        )
        assert r.choices[0].message.content == "ok"
    finally:
        await close_clients()
        await ep.aclose()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]},
         "messages[0].content[0] is a block of type 'image'"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "d"}}]}]},
         "block of type 'document'"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking 'enabled' is not served"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]: a 'web_search_20250305' tool"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]},
         "prefilling the answer is not served"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "'mcp_servers' is not served here"),
        ({"output_config": {"effort": "high"}}, "output_config {'effort': 'high'} is not served"),
        ({"container": "c1"}, "'container' is not served here"),
        ({"tool_choice": {"type": "any"}}, "tool_choice 'any' needs 'tools'"),
        ({"max_tokens": 0}, "'max_tokens' must be an integer in [1,"),
        ({"temperature": 1.5}, "'temperature' must be a number in [0.0, 1.0]"),
    ],
)  # fmt: skip
async def test_what_is_not_served_is_refused_in_anthropics_shape(
    endpoint: tuple[ChatEndpoint, Scripted], body: dict[str, Any], words: str
) -> None:
    ep, gen = endpoint
    _, url = ep.open_episode()
    ask = {"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}], **body}
    sdk_args = {
        k: v for k, v in ask.items() if k not in ("temperature", "mcp_servers")
    }  # not the SDK's: extra
    with pytest.raises(anthropic.BadRequestError) as e:
        await claude(url).messages.create(
            **sdk_args, extra_body={k: ask[k] for k in ask.keys() - sdk_args.keys()}
        )
    assert e.value.status_code == 400 and set(e.value.body) == {"type", "error"}  # type: ignore[arg-type]
    assert (
        e.value.body["error"]["type"] == "invalid_request_error" and words in e.value.body["error"]["message"]
    )  # type: ignore[index]
    assert not gen.requests  # nothing generated


async def test_errors_on_the_messages_paths_are_anthropics_shape(
    endpoint: tuple[ChatEndpoint, Scripted],
) -> None:
    ep, _ = endpoint
    async with httpx.AsyncClient(base_url=ep.url) as http:
        bad = await http.post("/v1/messages", content=b"{not json")
        gone = await http.post("/episodes/nope/v1/messages", json={})
        wrong = await http.get("/v1/messages")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert gone.status_code == 404 and gone.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no episode 'nope' is open here"},
    }
    assert wrong.status_code == 405 and wrong.json()["type"] == "error"


async def test_a_named_tool_choice_forces_the_call_streamed_or_not(
    endpoint: tuple[ChatEndpoint, Scripted],
    tokenizer: Any,  # noqa: F811
) -> None:
    """``tool_choice: {"type": "tool", "name": ...}``: the call's opening is written for the model
    (context, not trained on), the model writes the rest, the answer is that tool_use."""
    ep, gen = endpoint
    gen.streams = True
    rest = '{"a": 2, "b": 3}}\n</tool_call>'
    gen.script = [rest, rest]
    episode, url = ep.open_episode()
    client = claude(url)
    ask: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 64,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "add"},
        "messages": [{"role": "user", "content": "2+3?"}],
    }
    whole = await client.messages.create(**ask)
    async with client.messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    for m in (whole, streamed):
        (use,) = m.content
        assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 2, "b": 3}
        assert m.stop_reason == "tool_use"
    assert tokenizer.decode(gen.requests[0].input_ids).endswith('<tool_call>\n{"name": "add", "arguments": ')
    assert all(
        s.mask.sum() == len(out_ids(tokenizer, rest)) for s in episode.samples
    )  # the opening not trained


async def test_a_failed_generation_is_an_api_error_whole_or_mid_stream(tokenizer: Any) -> None:  # noqa: F811
    from tests.rollout.test_openai_endpoint import FailsMidStream

    ep = ChatEndpoint(FailsMidStream(tokenizer, []), tokenizer, "tiny")
    await ep.start()
    try:
        episode, url = ep.open_episode()
        client = claude(url)
        ask: dict[str, Any] = {
            "model": "tiny",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "x"}],
        }
        with pytest.raises(anthropic.InternalServerError) as e:
            await client.messages.create(**ask)
        assert e.value.status_code == 503 and e.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        with pytest.raises(anthropic.APIStatusError, match="generation failed: every server failed"):
            async with client.messages.stream(**ask) as stream:
                await stream.get_final_message()
        assert episode.counters["errors"] == 2
    finally:
        await close_clients()
        await ep.aclose()


def test_a_request_reads_as_the_chat_conversation_it_means() -> None:
    """System blocks, a user turn of tool results then text (tool messages, then a user message), an
    assistant turn of text and tool_use blocks (one message with its calls), an empty turn."""
    from protocols.http.anthropic import MessagesRequest

    req = MessagesRequest.from_json(
        {
            "max_tokens": 8,
            "system": [
                {"type": "text", "text": "Use ", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "tools."},
            ],
            "messages": [
                {"role": "user", "content": "2+3?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Adding."},
                        {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 2, "b": 3}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "5"}],
                        },
                        {"type": "text", "text": "Now "},
                        {"type": "text", "text": "say it."},
                    ],
                },
                {"role": "assistant", "content": []},
                {"role": "user", "content": []},
            ],
            "tools": TOOLS,
            "tool_choice": {"type": "any"},
        }
    )
    call = {"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    assert req.chat_messages() == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [call]},
        {"role": "tool", "content": "5", "tool_call_id": "t1"},
        {"role": "user", "content": "Now say it."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": ""},
    ]
    assert req.chat_tools() == CHAT_TOOLS and req.chat_tool_choice() == "required"
    # a call served with arguments text that is not its input's JSON is read back as served
    assert (
        req.chat_messages({"t1": '{"a":2,"b":3}'})[2]["tool_calls"][0]["function"]["arguments"]
        == '{"a":2,"b":3}'
    )
