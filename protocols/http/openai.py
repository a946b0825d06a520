"""OpenAI's chat-completions and Responses protocols, as the OpenAI-compatible endpoint reads them:
the request bodies (:class:`ChatCompletionRequest`, :class:`ResponsesRequest`) and the error shape.

Pure data and validation (pydantic models), no I/O. :meth:`ChatCompletionRequest.from_json` parses
a decoded JSON body; the first violation raises :class:`OpenAIError` with the message and the
``param`` OpenAI's error body names. Keys a chat request does not use (``model``, ``user``, ...) are
ignored, as OpenAI-compatible servers do; a Responses request refuses any key it does not know (the
API has many features the endpoint does not serve: refused by name, never silently dropped). A JSON
``null`` means "not given".
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

__all__ = [
    "MAX_N",
    "MAX_TOP_LOGPROBS",
    "ChatCompletionRequest",
    "OpenAIError",
    "ResponsesRequest",
    "error_body",
]

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


# Bounded numbers: each says its range in a validation error (:class:`_Says`).
_Choices = Annotated[int, Field(ge=1, le=MAX_N), _Says(f"an integer in [1, {MAX_N}]")]
_TopLogprobs = Annotated[
    int, Field(ge=0, le=MAX_TOP_LOGPROBS), _Says(f"an integer in [0, {MAX_TOP_LOGPROBS}]")
]
_Tokens = Annotated[int, Field(ge=1, le=MAX_TOKENS), _Says(f"an integer in [1, {MAX_TOKENS}]")]
_Seed = Annotated[
    int, Field(ge=-(1 << 63), le=(1 << 63) - 1), _Says(f"an integer in [{-(1 << 63)}, {(1 << 63) - 1}]")
]
_Temperature = Annotated[float, Field(ge=0.0, le=2.0), _Says("a number in [0.0, 2.0]")]
_TopP = Annotated[float, Field(ge=0.0, le=1.0), _Says("a number in [0.0, 1.0]")]
_Penalty = Annotated[float, Field(ge=-2.0, le=2.0), _Says("a number in [-2.0, 2.0]")]


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
                {
                    "id": str(c.id or ""),
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
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


class _Body(BaseModel):
    """A request body: a JSON object, its null fields counted as absent (as OpenAI's API does)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise _fail("the request body must be a JSON object", None)
        return {k: v for k, v in data.items() if v is not None}


class ChatCompletionRequest(_Body):
    """The ``/v1/chat/completions`` body (the fields the endpoint honours)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    messages: Annotated[list[Message], Field(min_length=1)]
    tools: Annotated[
        list[dict[str, Any]] | None,
        BeforeValidator(lambda v: v or None),
        AfterValidator(lambda v: None if v is None else _tools_as_sent(v)),
    ] = None
    # "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}
    tool_choice: Annotated[str | dict[str, Any] | None, BeforeValidator(lambda v: v or None)] = None
    n: _Choices = 1
    logprobs: Any = False  # any true value asks for log-probs
    top_logprobs: _TopLogprobs = 0
    max_completion_tokens: _Tokens | None = None  # wins over max_tokens
    max_tokens: _Tokens | None = None
    temperature: _Temperature | None = None
    top_p: _TopP | None = None
    frequency_penalty: _Penalty | None = None
    presence_penalty: _Penalty | None = None
    seed: _Seed | None = None
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


# ---- the Responses API -------------------------------------------------------------------

# Tool and item types of the Responses API the endpoint does not serve: refused by name, never ignored
_BUILT_IN_TOOLS = "web search, file search, computer use, code interpreter, MCP, image generation, shell"


class _ResponsesTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def as_chat(self) -> dict[str, Any]:
        """The tool as chat completions (and the chat template) know it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def _tool_types(tools: list[_ResponsesTool]) -> list[_ResponsesTool]:
    for i, t in enumerate(tools):
        if t.type != "function":
            raise _fail(
                f"tools[{i}] is a {t.type!r} tool: only function tools are served here "
                f"(no built-in tools: {_BUILT_IN_TOOLS})",
                f"tools[{i}].type",
            )
        if not t.name:
            raise _fail(f"tools[{i}].name is required", f"tools[{i}].name")
    return tools


class ResponsesRequest(_Body):
    """The ``/v1/responses`` body: the fields the endpoint serves, those it may ignore (``model``,
    ``metadata``, ...), and none else: any other field is refused by name (OpenAI's 400)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    # a factory, not ``[]``: pydantic deep-copies a mutable default for every request
    tools: Annotated[list[_ResponsesTool], AfterValidator(_tool_types)] = Field(default_factory=list)
    # "auto" | "none" | "required" | {"type": "function", "name": ...}
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: _Tokens | None = None
    temperature: _Temperature | None = None
    top_p: _TopP | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    # accepted and ignored: they change nothing of what the endpoint generates
    model: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    # accepted only as the defaults (anything else is a feature not served)
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _served(self) -> Self:
        if self.include:
            raise _fail(f"include {self.include!r} is not served here (leave it empty)", "include")
        if self.text is not None:
            fmt = self.text.get("format") or {"type": "text"}
            if fmt.get("type") != "text" or set(self.text) - {"format"}:
                raise _fail("text: only plain text output is served ({'format': {'type': 'text'}})", "text")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise _fail("reasoning is not served here (the model has no reasoning settings)", "reasoning")
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if isinstance(choice, dict):
            if choice.get("type") != "function":
                raise _fail(
                    f"tool_choice {choice!r}: only a function (or auto, none, required) is served",
                    "tool_choice",
                )
            if choice.get("name") not in {t.name for t in self.tools}:
                raise _fail(
                    f"tool_choice names {choice.get('name')!r}, which is not in 'tools'", "tool_choice"
                )
        elif choice not in ("auto", "none", "required") or (choice == "required" and not self.tools):
            raise _fail(
                f"tool_choice {choice!r} is not auto, none, required (with tools) or a function",
                "tool_choice",
            )
        self.tool_choice = choice
        return self

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` in chat completions' shape (None: none)."""
        return [t.as_chat() for t in self.tools] or None

    def chat_tool_choice(self) -> str | dict[str, Any]:
        """``tool_choice`` in chat completions' shape."""
        c = self.tool_choice
        return {"type": "function", "function": {"name": c["name"]}} if isinstance(c, dict) else str(c)

    def messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages (as :meth:`_Message.normalized` gives them): an assistant's
        text and the function calls after it are one message, a call's output a tool message.
        Items the endpoint does not serve (reasoning, built-in tools' calls, images, files,
        references) raise :class:`OpenAIError` naming them."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in _ROLES:
                    raise OpenAIError(
                        f"{where}.role must be system, developer, user or assistant, got {role!r}", where
                    )
                text = _item_text(item.get("content"), where)
                if role == "assistant" and out and out[-1]["role"] == "assistant" and not out[-1]["content"]:
                    out[-1]["content"] = text  # defensive: text after calls of the same turn
                else:
                    out.append({"role": _ROLES[role], "content": text})
            elif kind == "function_call":
                call = _function_call(item, where)
                last = out[-1] if out else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": ""}
                    out.append(last)
                last.setdefault("tool_calls", []).append(call)
            elif kind == "function_call_output":
                output = item.get("output")
                if not isinstance(item.get("call_id"), str):
                    raise OpenAIError(f"{where}.call_id is required", f"{where}.call_id")
                text = output if isinstance(output, str) else _item_text(output, f"{where}.output")
                out.append({"role": "tool", "content": text, "tool_call_id": item["call_id"]})
            else:
                raise OpenAIError(
                    f"{where} is a {kind!r} item: only messages, function_call and function_call_output "
                    "items are served here (no reasoning, built-in tool calls or item references)",
                    f"{where}.type",
                )
        if not out:
            raise OpenAIError("'input' must not be empty", "input")
        return out

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Parse and check a decoded JSON body; the first violation raises :class:`OpenAIError`."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            if err["type"] == "openai":
                raise OpenAIError(err["ctx"]["message"], err["ctx"]["param"]) from None
            field = ".".join(
                str(p) for p in err["loc"] if not str(p).startswith(("function-", "str", "list"))
            )
            top = str(err["loc"][0]) if err["loc"] else None
            if err["type"] == "extra_forbidden":
                raise OpenAIError(
                    f"'{top}' is not served here (unknown or unsupported parameter)", top
                ) from None
            if err["type"] == "missing":
                raise OpenAIError(f"'{field}' is required", field) from None
            info = cls.model_fields.get(top or "")
            says = _says(
                Annotated[info.annotation, *info.metadata]
                if info and info.metadata
                else info.annotation
                if info
                else None
            )
            if says is not None:
                raise OpenAIError(f"'{top}' must be {says}, got {err['input']!r}", top) from None
            raise OpenAIError(f"'{field or top}': {err['msg']}", top) from None


def _item_text(content: Any, where: str) -> str:
    """A message item's content as text: a string or text parts (input_text, output_text)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise OpenAIError(
                f"{where}.content[{j}] is a {kind!r} part: only text parts are served here",
                f"{where}.content",
            )
        texts.append(part["text"])
    return "".join(texts)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` item as a chat tool call."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise OpenAIError(f"{where}.{key} must be a string", f"{where}.{key}")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
