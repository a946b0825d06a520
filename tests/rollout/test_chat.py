"""nodes/rollout/chat.py's tokenising: the Rust tokenizer called directly gives the ids
transformers' ``encode`` gives, and a tokenizer without one goes through ``encode``."""

from __future__ import annotations

from typing import Any

import pytest

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.rollout import chat

TEXTS = [
    "",
    "What is 12 + 30? Think step by step.",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "  leading spaces, trailing tabs\t\t\n\n12345678901234567890 3.14159 -7",
    "unicode: naïve café ✓ 你好 🙂 \u200b",
    "<|endoftext|> special tokens written as text <|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_tiny_checkpoint()), local_files_only=True)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_gives_transformers_ids(tokenizer: Any, text: str) -> None:
    assert tokenizer.backend_tokenizer is not None  # the direct path is the one under test
    assert chat.encode(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False)


def test_prompt_ids_are_the_rendered_template_encoded(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[5]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.prompt_ids(tokenizer, messages, None) == tokenizer.encode(text, add_special_tokens=False)


def test_a_tokenizer_without_a_rust_backend_uses_its_encode() -> None:
    class Slow:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert add_special_tokens is False
            return [len(text)]

    assert chat.encode(Slow(), "four") == [4]


# a template that renders tools and tool calls itself (as Qwen's does), to test the native path
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{%- if m.tool_call_id is defined %} ({{ m.tool_call_id }}){% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[5]}],
    [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call_1", "content": "5"}, {"role": "user", "content": "and?"}],
    [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": "y"}],  # None: left out
]  # fmt: skip


def through_transformers(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, generation: bool) -> str:
    """What render_messages renders, by transformers' own apply_chat_template."""
    native = chat.supports_tools(tokenizer)
    msgs = messages if native else chat._hermes(messages, tools)
    kwargs = {"tools": tools} if native and tools else {}
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation, **kwargs)


@pytest.mark.parametrize("native", [False, True], ids=["hermes-preamble", "native-tools"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("generation", [True, False])
def test_the_direct_template_renders_as_apply_chat_template(
    tokenizer: Any, native: bool, tools: Any, generation: bool
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_checkpoint()), local_files_only=True)
    if native:
        tok.chat_template = TOOLS_TEMPLATE
    assert chat.supports_tools(tok) is native and chat._direct_template(tok) is not None
    for messages in CONVERSATIONS:
        assert chat.render_messages(tok, messages, tools, generation=generation) == through_transformers(
            tok, messages, tools, generation
        )


def test_a_changed_template_is_rendered_and_a_disagreeing_one_goes_through_transformers(
    tokenizer: Any,
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_checkpoint()), local_files_only=True)
    first = chat.render_messages(tok, CONVERSATIONS[0], None, generation=True)
    tok.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert chat.render_messages(tok, CONVERSATIONS[0], None, generation=True) == "[user] hi\n" != first

    class Wrapped:  # apply_chat_template adds what the bare template does not: the direct path is refused
        chat_template = tok.chat_template
        special_tokens_map = tok.special_tokens_map

        def apply_chat_template(self, messages: Any, **kw: Any) -> str:
            return "<wrapped>" + tok.apply_chat_template(messages, **kw)

    wrapped = Wrapped()
    assert chat._direct_template(wrapped) is None
    assert chat.render_messages(wrapped, CONVERSATIONS[0], None, generation=True) == "<wrapped>[user] hi\n"
