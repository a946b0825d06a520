"""Anthropic's Messages protocol, as the rollout actor's endpoint reads it: the request bodies of
``/v1/messages`` and ``/v1/messages/count_tokens`` (:class:`MessagesRequest`,
:class:`CountTokensRequest`), their content blocks, and Anthropic's error shape.

Pure data and validation (pydantic models), no I/O. A body is read into the chat conversation it
means (:meth:`MessagesRequest.chat_messages`, :meth:`~MessagesRequest.chat_tools`,
:meth:`~MessagesRequest.chat_tool_choice`): ``system`` as the system message, a user's ``text``
blocks as a user message and its ``tool_result`` blocks as tool messages, an assistant's ``text``
and ``tool_use`` blocks as one assistant message with tool calls, custom tools' ``input_schema``
as function parameters. What the endpoint does not serve (images, documents, thinking, server
tools, an assistant prefill, MCP servers, ...) raises :class:`AnthropicError` naming it, with the
``param`` it is in; a key the body does not know is refused by name, never dropped. A JSON ``null``
means "not given".
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

__all__ = [
    "AnthropicError",
    "CountTokensRequest",
    "MessagesRequest",
    "TextBlock",
    "Tool",
    "ToolResultBlock",
    "ToolUseBlock",
    "error_body",
    "error_type",
    "tool_input",
]

MAX_TOKENS = 1 << 20

# Anthropic's error type for each HTTP status it answers with (anything else >= 500: api_error)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class AnthropicError(ValueError):
    """A request body Anthropic's API would refuse with HTTP 400; ``param`` names where."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` of an answer with HTTP ``status``."""
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def _fail(message: str, param: str | None) -> PydanticCustomError:
    """A refusal whose words and ``param`` are given (cross-field rules)."""
    return PydanticCustomError("anthropic", "{message}", {"message": message, "param": param})


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments (JSON text) as ``tool_use.input``, which must be an object: text
    that is not a JSON object (a model's malformed call) is ``{}``."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


# ---- content blocks ----------------------------------------------------------------------


class _Block(BaseModel):
    # cache_control, citations and the like change nothing the endpoint generates: ignored
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    """An assistant's tool call, as the agent sends it back."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    """A tool's result in a user message. ``is_error`` is accepted but not shown to the model (a
    chat template has no place for it): say it in the content."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


_USER_BLOCKS: dict[str, type[_Block]] = {"text": TextBlock, "tool_result": ToolResultBlock}
_ASSISTANT_BLOCKS: dict[str, type[_Block]] = {"text": TextBlock, "tool_use": ToolUseBlock}
_NOT_SERVED = "no images, documents, thinking, search results or server tools' blocks"


def _block(raw: Any, kinds: dict[str, type[_Block]], where: str) -> Any:
    """``raw`` as the typed block its ``type`` names, or :class:`AnthropicError` naming it."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    model = kinds.get(kind)  # type: ignore[arg-type]
    if model is None:
        allowed = " and ".join(kinds)
        raise AnthropicError(
            f"{where} is a block of type {kind!r}: only {allowed} blocks are served here ({_NOT_SERVED})",
            where,
        )
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"])
        raise AnthropicError(f"{where}.{field}: {err['msg']}", f"{where}.{field}") from None


def _text_of(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """A tool result's content as text: a string, or text blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(
        _block(b, {"text": TextBlock}, f"{where}.content[{j}]").text for j, b in enumerate(content)
    )


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


def _chat(i: int, m: _Message, args: dict[str, str]) -> list[dict[str, Any]]:
    """One Messages message as chat messages (``args``: a call id's served arguments text)."""
    where = f"messages[{i}]"
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "assistant":
        text, calls = [], []
        for j, raw in enumerate(m.content):
            b = _block(raw, _ASSISTANT_BLOCKS, f"{where}.content[{j}]")
            if isinstance(b, TextBlock):
                text.append(b.text)
            else:  # the text a call was served with, when its input is that text's object
                served = args.get(b.id)
                arguments = (
                    served if served is not None and tool_input(served) == b.input else json.dumps(b.input)
                )
                calls.append(
                    {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": arguments}}
                )
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    out: list[dict[str, Any]] = []
    for j, raw in enumerate(m.content):
        b = _block(raw, _USER_BLOCKS, f"{where}.content[{j}]")
        if isinstance(b, ToolResultBlock):
            result = _text_of(b.content, f"{where}.content[{j}]")
            out.append({"role": "tool", "content": result, "tool_call_id": b.tool_use_id})
        elif out and out[-1]["role"] == "user":  # consecutive text blocks: one message
            out[-1]["content"] += b.text
        else:
            out.append({"role": "user", "content": b.text})
    return out or [{"role": "user", "content": ""}]  # no blocks: still a user turn


# ---- tools -------------------------------------------------------------------------------


class Tool(BaseModel):
    """A custom tool: a name, what it does, its input's JSON schema."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(
                f"a {kind!r} tool: only custom tools (name, input_schema) are served here, no server tools"
            )
        return data

    def as_chat(self) -> dict[str, Any]:
        """The tool as chat completions (and the chat template) know it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.input_schema
        return {"type": "function", "function": fn}


class _ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # accepted: one answer may still make several calls


class _Thinking(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str


# ---- the requests ------------------------------------------------------------------------


class _Conversation(BaseModel):
    """What both requests read: the conversation, its system prompt, its tools."""

    model_config = ConfigDict(extra="forbid", strict=True)

    messages: Annotated[list[_Message], Field(min_length=1)]
    model: str | None = None  # accepted: the endpoint serves its one model under any name
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: _ToolChoice | None = None
    thinking: _Thinking | None = None
    # accepted only empty: effort levels and structured output formats are not served
    output_config: dict[str, Any] | None = None
    # accepted and ignored: they change nothing the endpoint generates or answers
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise _fail("the request body must be a JSON object", None)
        return {k: v for k, v in data.items() if v is not None}

    @model_validator(mode="after")
    def _served(self) -> Self:
        # "adaptive" leaves thinking to the model, which here never thinks: served as asked
        if self.thinking is not None and self.thinking.type not in ("disabled", "adaptive"):
            raise _fail(
                f"thinking {self.thinking.type!r} is not served here (the model has no thinking settings): "
                "leave it out, or disabled",
                "thinking",
            )
        if self.output_config and any(v is not None for v in self.output_config.values()):
            raise _fail(
                f"output_config {self.output_config!r} is not served here (no effort levels, no structured "
                "output formats): leave it out",
                "output_config",
            )
        if self.messages[-1].role == "assistant":
            raise _fail(
                "the last message is the assistant's: prefilling the answer is not served here; "
                "end with a user message",
                f"messages[{len(self.messages) - 1}]",
            )
        c = self.tool_choice
        if c is not None:
            if c.type in ("any", "tool") and not self.tools:
                raise _fail(f"tool_choice {c.type!r} needs 'tools'", "tool_choice")
            if c.type == "tool" and c.name not in {t.name for t in self.tools}:
                raise _fail(f"tool_choice names {c.name!r}, which is not in 'tools'", "tool_choice")
        return self

    def chat_messages(self, args: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """The conversation as chat messages (``system`` first), as the endpoint renders and
        matches them; ``args``: call id -> the arguments text its call was served with, so a call
        sent back as an object is the served call again."""
        out = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else _text_of(self.system, "system")
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            out += _chat(i, m, args or {})
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` in chat completions' shape (None: none)."""
        return [t.as_chat() for t in self.tools] or None

    def chat_tool_choice(self) -> str | dict[str, Any]:
        """``tool_choice`` in chat completions' shape."""
        c = self.tool_choice
        if c is None or c.type == "auto":
            return "auto" if self.tools else "none"
        if c.type == "tool":
            return {"type": "function", "function": {"name": c.name}}
        return "required" if c.type == "any" else "none"

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Parse and check a decoded JSON body; the first violation raises :class:`AnthropicError`."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise _refusal(cls, e.errors(include_url=False)[0]) from None


class MessagesRequest(_Conversation):
    """The ``/v1/messages`` body: the fields the endpoint serves, those it may ignore (``model``,
    ``metadata``, ``service_tier``, ...), and none else. ``temperature``, ``top_p`` and ``top_k``
    are served although the current SDK's ``messages.create`` no longer takes them (give them in
    its ``extra_body``; older SDKs and other clients send them as fields)."""

    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)]
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted and ignored
    service_tier: str | None = None  # accepted and ignored


class CountTokensRequest(_Conversation):
    """The ``/v1/messages/count_tokens`` body."""


_RANGES = {
    "max_tokens": f"an integer in [1, {MAX_TOKENS}]",
    "temperature": "a number in [0.0, 1.0]",
    "top_p": "a number in [0.0, 1.0]",
    "top_k": "an integer >= 1",
    "stop_sequences": "a list of non-empty strings",
}


def _refusal(cls: type[BaseModel], err: Any) -> AnthropicError:
    """One pydantic error as Anthropic's message and where it is."""
    loc = [str(p) for p in err["loc"]]
    top = loc[0] if loc else None
    where = top if len(loc) < 2 else f"{top}[{loc[1]}]" + "".join(f".{p}" for p in loc[2:])
    if err["type"] == "extra_forbidden":
        if top == "messages":
            return AnthropicError(f"{where}: unknown key (a message has role and content)", where)
        return AnthropicError(f"'{top}' is not served here (unknown or unsupported parameter)", top)
    if err["type"] == "missing":
        return AnthropicError(f"'{where}' is required", where)
    if err["type"] == "anthropic":  # a cross-field rule's own words
        return AnthropicError(err["ctx"]["message"], err["ctx"]["param"])
    if err["type"] == "value_error":  # a tool that is not a custom one
        return AnthropicError(f"{where}: {str(err['ctx']['error']).removeprefix('Value error, ')}", where)
    if top in _RANGES:
        return AnthropicError(f"'{top}' must be {_RANGES[top]}, got {err['input']!r}", top)
    if top == "messages" and len(loc) > 2 and loc[2] == "role":
        return AnthropicError(f"{where} must be user or assistant, got {err['input']!r}", where)
    if top == "messages" and len(loc) > 2 and loc[2] == "content":
        where = f"messages[{loc[1]}].content"
        return AnthropicError(f"{where} must be a string or a list of blocks", where)
    return AnthropicError(f"'{where}': {err['msg']}", where)
