"""Chat conversations as token ids: rendering with the model's chat template (tools included),
tool calls read back from the model's output, and continuations that never re-tokenise what the
model generated.

A template that knows tools (it mentions ``tools``, as Qwen2.5's does) renders them itself. For one
that does not (SmolLM2's), :func:`render_messages` uses the Hermes format SGLang's ``qwen25`` parser
reads: the tool signatures in a preamble of the system message, an assistant's tool calls as
``<tool_call>{json}</tool_call>`` in its content, tool results as a user turn of
``<tool_response>`` blocks. :func:`parse_tool_calls` reads ``<tool_call>`` blocks from the output.

:func:`continuation_ids` is what makes a conversation one token sequence: the ids of the template's
text that closes the assistant's turn and opens the new messages, found by rendering the
conversation with a marker in place of the answer (so a template that rewrites content, e.g. with
``| trim``, still lines up) and tokenising only what follows it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TOOL_PREAMBLE",
    "ChatError",
    "ToolCall",
    "continuation_ids",
    "encode",
    "parse_tool_calls",
    "prompt_ids",
    "render_messages",
    "supports_tools",
    "tool_parser",
]

TOOL_PREAMBLE = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_MARK = "RLACTORS-ANSWER-4f1c"


class ChatError(ValueError):
    """A conversation the chat template cannot render as asked (bad roles, a template that does not
    extend a conversation by appending)."""


@dataclass
class ToolCall:
    """One function call the model made: OpenAI's ``tool_calls`` entry."""

    id: str
    name: str
    arguments: str  # a JSON object, as text

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments") or "{}"
    try:
        args_obj = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        args_obj = args
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args_obj}) + "\n</tool_call>"


def _hermes(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` for a template without tool support: tools in the system message, tool calls
    in the assistant's content, tool results as user turns of ``<tool_response>`` blocks."""
    out: list[dict[str, Any]] = []
    if tools:
        preamble = TOOL_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append(
                {"role": "system", "content": f"{messages[0]['content'] or ''}\n\n{preamble}".lstrip()}
            )
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": preamble})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            parts = [m.get("content") or "", *(_call_text(c) for c in m["tool_calls"])]
            out.append({"role": "assistant", "content": "\n".join(p for p in parts if p)})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool"):  # consecutive results: one user turn, as Qwen renders them
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return [{k: v for k, v in m.items() if k != "_tool"} for m in out]


def render_messages(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation: bool
) -> str:
    """The template's text for ``messages`` (and ``tools``), with the assistant header when
    ``generation``."""
    native = supports_tools(tokenizer)
    msgs = messages if native else _hermes(messages, tools)
    kwargs: dict[str, Any] = {"tools": tools} if native and tools else {}
    try:
        direct = _direct_template(tokenizer)
        if direct is not None:
            return direct(msgs, kwargs.get("tools"), generation)
        return str(
            tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation, **kwargs)
        )
    except Exception as e:  # jinja raises its own errors for conversations a template refuses
        raise ChatError(f"the chat template cannot render these messages: {e}") from e


# id(tokenizer) -> (tokenizer, its template, the direct renderer or None); a handful of tokenizers
_DIRECT: dict[int, tuple[Any, Any, Any]] = {}
_PROBES = [
    [{"role": "user", "content": "probe <|im_end|> {{ x }}"}],
    [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "v"},
    ],
]


def _direct_template(tokenizer: Any) -> Any:
    """``render(messages, tools, generation)`` through the tokenizer's compiled Jinja template, as
    ``apply_chat_template`` renders it without its wrapper (which copies and checks every message:
    about half of a short chat's rendering CPU; bench/RESULTS.md, "OpenAI-compatible endpoint").
    Only for a single string template,
    and only once it renders probe conversations exactly as ``apply_chat_template`` does (else
    None: that is used). Messages reach it already plain (dicts of strings)."""
    template = getattr(tokenizer, "chat_template", None)
    kept = _DIRECT.get(id(tokenizer))
    if kept is not None and kept[0] is tokenizer and kept[1] is template:
        return kept[2]
    render = None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(template) if isinstance(template, str) else None
    except Exception:  # another transformers: its wrapper, then
        compiled = None
    if compiled is not None:
        special = dict(tokenizer.special_tokens_map)

        def direct(messages: list[dict[str, Any]], tools: Any, generation: bool) -> str:
            return str(
                compiled.render(
                    messages=[
                        m
                        if all(v is not None for v in m.values())
                        else {k: v for k, v in m.items() if v is not None}
                        for m in messages
                    ],
                    tools=tools,
                    documents=None,
                    add_generation_prompt=generation,
                    **special,
                )
            )

        try:
            same = all(
                direct(p, None, g)
                == tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=g)
                for p in _PROBES
                for g in (True, False)
            )
        except Exception:  # a tokenizer's template may raise anything: then render through it
            same = False
        render = direct if same else None
    _DIRECT[id(tokenizer)] = (tokenizer, template, render)
    return render


def prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """Token ids of a conversation's prompt (the assistant header last)."""
    return encode(tokenizer, render_messages(tokenizer, messages, tools, generation=True))


def encode(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=False)``, through the Rust tokenizer directly
    when there is one: the same ids at a fraction of the CPU (transformers' wrapper builds a batch
    encoding around it; bench/RESULTS.md, "OpenAI-compatible endpoint")."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(backend.encode(text, add_special_tokens=False).ids)


def continuation_ids(
    tokenizer: Any,
    history: list[dict[str, Any]],
    new: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    output_ids: list[int],
    finish_reason: str,
) -> list[int]:
    """Ids that follow the model's ``output_ids`` (its answer to ``history``) when ``new`` messages
    are appended: the template's end of the assistant turn (unless the model emitted the
    end-of-turn token itself), the new messages, and the next assistant header."""
    marked = [*history, {"role": "assistant", "content": _MARK}]
    with_answer = render_messages(tokenizer, marked, tools, generation=False)
    with_new = render_messages(tokenizer, [*marked, *new], tools, generation=True)
    if not with_new.startswith(with_answer):
        raise ChatError("the chat template does not extend a conversation by appending to it")
    end = with_answer.rfind(_MARK)
    if end < 0:
        raise ChatError("the chat template drops the assistant's answer")
    closing = with_answer[end + len(_MARK) :]
    eos = getattr(tokenizer, "eos_token", None) or ""
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if finish_reason == "stop" and eos and closing.startswith(eos) and output_ids[-1:] == [eos_id]:
        closing = closing[len(eos) :]  # the model emitted the end-of-turn token itself
    return encode(tokenizer, closing + with_new[len(with_answer) :])


TOOL_PARSERS = {
    "hermes": "nodes.rollout.chat:parse_tool_calls",
    "qwen25": "nodes.rollout.chat:parse_tool_calls",
}


def tool_parser(name: str) -> Any:
    """The tool-call parser named ``name``: ``hermes`` (also ``qwen25``, SGLang's name for the same
    format), or your own ``fn(text) -> (content, [ToolCall])`` by import path ``module:fn``."""
    from nodes.common.plugins import resolve

    if name not in TOOL_PARSERS and ":" not in name:
        raise ValueError(
            f"tool parser {name!r}: use {' or '.join(TOOL_PARSERS)}, or an import path 'module:fn'"
        )
    return resolve(TOOL_PARSERS.get(name, name), "tool_parser")


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """``(content, tool calls)`` of an assistant's output in the Hermes format: the text before the
    first ``<tool_call>`` (None if empty) and each block whose JSON names a function. A block that
    is not such JSON stays in the content, as SGLang's parser leaves text it cannot read."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    bad: list[str] = []
    for m in _TOOL_CALL.finditer(text, start):
        try:
            obj = json.loads(m.group(1))
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError(name)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            bad.append(m.group(0))
            continue
        arguments = args if isinstance(args, str) else json.dumps(args)
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments))
    content = (text[:start].strip() + "".join(bad)).strip() if calls else text
    return content or None, calls
