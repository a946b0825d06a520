"""The chat-completions body as protocols/http/openai.py reads it: each malformed field refused with
OpenAI's message and ``param``, and a good body read into what the endpoint generates with."""

from __future__ import annotations

from typing import Any

import pytest

from nodes.rollout.openai_endpoint import ChatRequest, EndpointError
from protocols.http.openai import ChatCompletionRequest, OpenAIError

U = [{"role": "user", "content": "x"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds", "parameters": {}}}]
DEFAULTS = {"max_new_tokens": 1024, "temperature": 1.0}


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ([], "the request body must be a JSON object", None),
        ({"messages": []}, "'messages' must be a non-empty list", "messages"),
        ({"messages": [5]}, "messages[0] must be an object", "messages[0]"),
        (
            {"messages": [{"role": "wizard"}]},
            "messages[0].role must be system, developer, user, assistant or tool, got 'wizard'",
            "messages[0]",
        ),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content must be a string or a list of text parts",
            "messages[0].content",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}
                ]
            },
            "messages[0].content[1]: only text content parts are supported",
            "messages[0].content",
        ),
        (
            {"messages": [{"role": "tool", "content": "5"}]},
            "messages[0].tool_call_id is required for a tool message",
            "messages[0]",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
                ]
            },
            "messages[0].tool_calls[0].function.arguments must be a string",
            "messages[0].tool_calls[0]",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
            "messages[0].tool_calls[0].function.name is required",
            "messages[0].tool_calls[0]",
        ),
        ({"messages": U, "n": 0}, "'n' must be an integer in [1, 16], got 0", "n"),
        ({"messages": U, "n": True}, "'n' must be an integer in [1, 16], got True", "n"),
        (
            {"messages": U, "temperature": 3},
            "'temperature' must be a number in [0.0, 2.0], got 3",
            "temperature",
        ),
        (
            {"messages": U, "max_completion_tokens": 0},
            "'max_tokens' must be an integer in [1, 1048576], got 0",
            "max_tokens",
        ),
        ({"messages": U, "stop": ["a"] * 5}, "'stop' must be a string or up to 4 strings", "stop"),
        (
            {"messages": U, "tools": [{"function": {}}]},
            "'tools' must be a list of {type: function, function: {name, ...}}",
            "tools",
        ),
        (
            {"messages": U, "tool_choice": "required"},
            "tool_choice 'required' is not auto, none, required (with tools) or a function",
            "tool_choice",
        ),
        (
            {"messages": U, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}},
            "tool_choice names 'sub', which is not in 'tools'",
            "tool_choice",
        ),
        ({"messages": U, "top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true", "top_logprobs"),
    ],
)
def test_a_malformed_field_is_named(body: Any, message: str, param: str | None) -> None:
    with pytest.raises(OpenAIError) as e:
        ChatCompletionRequest.from_json(body)
    assert (str(e.value), e.value.param) == (message, param)
    with pytest.raises(EndpointError) as refused:
        ChatRequest.parse(body, DEFAULTS)
    assert (refused.value.status, str(refused.value), refused.value.param) == (400, message, param)


def test_a_good_body_is_read_into_the_endpoints_terms() -> None:
    body = {
        "model": "ignored",
        "messages": [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            },
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "add"}}]},
            {"role": "tool", "content": "4", "tool_call_id": "c1"},
        ],
        "tools": TOOLS,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "max_tokens": 9,
        "top_p": 1,
        "seed": 5,
        "stop": "END",
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": None,
    }
    req = ChatRequest.parse(body, DEFAULTS)
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ]
    assert req.tools == TOOLS and req.tool_choice == "auto"  # the tools as sent, for the chat template
    assert (req.n, req.stream, req.include_usage, req.logprobs, req.top_logprobs) == (2, True, True, True, 3)
    assert req.sampling == {
        "max_new_tokens": 9,
        "temperature": 1.0,
        "top_p": 1.0,
        "sampling_seed": 5,
        "stop": ["END"],
    }
    assert isinstance(req.sampling["top_p"], float)
