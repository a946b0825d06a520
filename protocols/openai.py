"""OpenAI's chat-completions protocol, as the OpenAI-compatible endpoint reads it: the request body
and the error shape.

Pure data and validation (pydantic models), no I/O. :meth:`ChatCompletionRequest.from_json` parses
a decoded JSON body; the first violation raises :class:`OpenAIError` with the message and the
``param`` OpenAI's error body names. Keys the endpoint does not use (``model``, ``user``, ...) are
ignored, as OpenAI-compatible servers do; a JSON ``null`` means "not given".
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Self, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = ["MAX_N", "MAX_TOP_LOGPROBS", "ChatCompletionRequest", "OpenAIError", "error_body"]

MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_STOP = 4  # stop strings, as OpenAI
MAX_TOKENS = 1 << 20


class OpenAIError(ValueError):
    """A request body OpenAI would refuse with HTTP 400; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---- schema machinery --------------------------------------------------------------------


class _Says:
    """What a field must be, in the words of the error that refuses it: ``'n' must be <text>``."""

    def __init__(self, text: str) -> None:
        self.text = text


def _int_in(lo: int, hi: int) -> Any:
    return Annotated[int, Field(ge=lo, le=hi), _Says(f"an integer in [{lo}, {hi}]")]


def _number_in(lo: float, hi: float) -> Any:
    return Annotated[float, Field(ge=lo, le=hi), _Says(f"a number in [{lo}, {hi}]")]


def _says(tp: Any) -> str | None:
    """The :class:`_Says` text of a field's type (through ``X | None``)."""
    for meta in getattr(tp, "__metadata__", ()):
        if isinstance(meta, _Says):
            return meta.text
    if get_origin(tp) in (Union, types.UnionType):
        for arg in get_args(tp):
            if (text := _says(arg)) is not None:
                return text
    return None


def _fail(message: str, param: str | None) -> PydanticCustomError:
    """A refusal whose words and ``param`` are given (cross-field rules)."""
    return PydanticCustomError("openai", "{message}", {"message": message, "param": param})


_TAG = "*"  # prefix of union tags; dropped from the places errors name


def _by_type(value: Any) -> str:
    return _TAG + ("list" if isinstance(value, list) else "one")


class _Part(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


# a message's content: a string, or a list of text parts (null: empty)
Content = Annotated[
    Union[Annotated[str, Tag(_TAG + "one")], Annotated[list[_Part], Tag(_TAG + "list")]],
    Discriminator(_by_type),
]


class _Function(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    """An assistant message's tool call, as an agent sends it back."""

    id: Any = None
    function: _Function


class _Message(BaseModel):
    content: Content | None = None

    def normalized(self) -> dict[str, Any]:
        """What rendering and matching need: role, content as text, tool calls, tool call id."""
        content = self.content
        text = (
            ""
            if content is None
            else content
            if isinstance(content, str)
            else "".join(p.text for p in content)
        )
        return {"role": self.role, "content": text}  # type: ignore[attr-defined]


class SystemMessage(_Message):
    """``system`` (or OpenAI's newer ``developer``, the same to a chat template)."""

    role: Literal["system", "developer"]

    def normalized(self) -> dict[str, Any]:
        return {**super().normalized(), "role": "system"}


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    # an empty or absent list: none (anything falsy counts as none, as before)
    tool_calls: Annotated[list[ToolCall] | None, BeforeValidator(lambda v: v or None)] = None

    def normalized(self) -> dict[str, Any]:
        msg = super().normalized()
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": str(c.id or ""), "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls
            ]  # fmt: skip
        return msg


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: Annotated[str, Field(strict=True)]

    def normalized(self) -> dict[str, Any]:
        return {**super().normalized(), "tool_call_id": self.tool_call_id}


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _role(value: Any) -> str | None:
    return _ROLES.get(value.get("role")) if isinstance(value, dict) else None  # type: ignore[arg-type]


Message = Annotated[
    Union[
        Annotated[SystemMessage, Tag("system")],
        Annotated[UserMessage, Tag("user")],
        Annotated[AssistantMessage, Tag("assistant")],
        Annotated[ToolMessage, Tag("tool")],
    ],
    Discriminator(_role),
]


class _ToolFunction(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str


class _ToolSpec(BaseModel):
    function: _ToolFunction


_TOOLS = TypeAdapter(list[_ToolSpec])


def _tools_as_sent(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools are checked against their schema but kept as sent: the chat template renders them."""
    _TOOLS.validate_python(tools)
    return tools


# ---- the request -------------------------------------------------------------------------


class ChatCompletionRequest(BaseModel):
    """The ``/v1/chat/completions`` body (the fields the endpoint honours)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    messages: Annotated[list[Message], Field(min_length=1)]
    tools: Annotated[
        list[dict[str, Any]] | None, BeforeValidator(lambda v: v or None), AfterValidator(
            lambda v: None if v is None else _tools_as_sent(v))
    ] = None  # fmt: skip
    # "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}
    tool_choice: Annotated[str | dict[str, Any] | None, BeforeValidator(lambda v: v or None)] = None
    n: _int_in(1, MAX_N) = 1
    logprobs: Any = False  # any true value asks for log-probs
    top_logprobs: _int_in(0, MAX_TOP_LOGPROBS) = 0
    max_completion_tokens: _int_in(1, MAX_TOKENS) | None = None  # wins over max_tokens
    max_tokens: _int_in(1, MAX_TOKENS) | None = None
    temperature: _number_in(0.0, 2.0) | None = None
    top_p: _number_in(0.0, 1.0) | None = None
    frequency_penalty: _number_in(-2.0, 2.0) | None = None
    presence_penalty: _number_in(-2.0, 2.0) | None = None
    seed: _int_in(-(1 << 63), (1 << 63) - 1) | None = None
    stop: (
        Annotated[
            Union[
                Annotated[str, Field(min_length=1), Tag(_TAG + "one")],
                Annotated[
                    list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP), Tag(_TAG + "list")
                ],
            ],
            Discriminator(_by_type),
        ]
        | None
    ) = None
    stream: Any = False  # any true value streams
    stream_options: Annotated[dict[str, Any] | None, BeforeValidator(lambda v: v or None)] = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise _fail("the request body must be a JSON object", None)
        return {k: v for k, v in data.items() if v is not None}

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        names = {t["function"]["name"] for t in self.tools or ()}
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if name not in names:
                raise _fail(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice")
        elif choice not in ("auto", "none", "required") or (choice == "required" and not self.tools):
            raise _fail(
                f"tool_choice {choice!r} is not auto, none, required (with tools) or a function",
                "tool_choice",
            )
        self.tool_choice = choice
        if self.top_logprobs and not self.logprobs:
            raise _fail("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return self

    @property
    def stop_strings(self) -> list[str] | None:
        """``stop`` as a list (None: not given)."""
        return [self.stop] if isinstance(self.stop, str) else self.stop

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Parse and check a decoded JSON body; the first violation raises :class:`OpenAIError`."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise _refusal(e.errors(include_url=False)[0]) from None


def _refusal(err: Any) -> OpenAIError:
    """One pydantic error as OpenAI's message and ``param``."""
    if err["type"] == "openai":
        return OpenAIError(err["ctx"]["message"], err["ctx"]["param"])
    loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith(_TAG))]
    field, value = str(loc[0]), err["input"]
    if field == "messages":
        return _message_refusal(loc, value)
    if field == "tools":
        return OpenAIError("'tools' must be a list of {type: function, function: {name, ...}}", "tools")
    if field == "tool_choice":
        msg = f"tool_choice {value!r} is not auto, none, required (with tools) or a function"
        return OpenAIError(msg, "tool_choice")
    if field == "stop":
        return OpenAIError(f"'stop' must be a string or up to {MAX_STOP} strings", "stop")
    if field == "max_completion_tokens":
        field = "max_tokens"  # OpenAI's older name for it, as the endpoint reports both
    info = ChatCompletionRequest.model_fields[str(loc[0])]
    says = _says(Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation)
    if says is not None:
        return OpenAIError(f"'{field}' must be {says}, got {value!r}", field)
    return OpenAIError(f"'{field}': {err['msg']}", field)


def _message_refusal(loc: list[Any], value: Any) -> OpenAIError:
    if len(loc) == 1:
        return OpenAIError("'messages' must be a non-empty list", "messages")
    where = f"messages[{loc[1]}]"
    if len(loc) == 2:
        if not isinstance(value, dict):
            return OpenAIError(f"{where} must be an object", where)
        msg = f"{where}.role must be system, developer, user, assistant or tool, got {value.get('role')!r}"
        return OpenAIError(msg, where)
    rest = loc[3:]  # after the role's tag
    if rest[0] == "content":
        if len(rest) > 1:
            return OpenAIError(
                f"{where}.content[{rest[1]}]: only text content parts are supported", f"{where}.content"
            )
        return OpenAIError(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    if rest[0] == "tool_calls":
        if len(rest) == 1:
            return OpenAIError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        call = f"{where}.tool_calls[{rest[1]}]"
        if "arguments" in rest:
            return OpenAIError(f"{call}.function.arguments must be a string", call)
        return OpenAIError(f"{call}.function.name is required", call)
    if rest[0] == "tool_call_id":
        return OpenAIError(f"{where}.tool_call_id is required for a tool message", where)
    return OpenAIError(f"{where}: invalid message", where)
