"""An OpenAI-SDK agent with a synthetic reward that a random-weight model can learn, for the agent
learning test (test_agent_learning.py).

Two turns: it asks, then sends a follow-up user message after the model's answer, so the second
request continues the first and the episode is one token sequence (token-exact continuation). The
reward is :func:`tests.e2e.learning_reward.no_space_share` over both answers, per generated token.
"""

from __future__ import annotations

from typing import Any

TURNS = 2


async def run(client: Any, item: dict[str, Any]) -> dict[str, float]:
    """One episode: ask, answer, follow up, answer; the share of tokens without a space."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": item["question"]}]
    text, tokens = "", 0
    for turn in range(TURNS):
        if turn:
            messages.append({"role": "user", "content": "Go on."})
        r = await client.chat.completions.create(model="policy", messages=messages)
        msg = r.choices[0].message
        messages.append({"role": "assistant", "content": msg.content or ""})
        text += msg.content or ""
        tokens += r.usage.completion_tokens
    return {
        "reward": max(0.0, 1.0 - text.count(" ") / max(1, tokens)),
        "turns": sum(m["role"] == "assistant" for m in messages),
        # what the model generated, as the endpoint counted it: the loss mask should cover exactly these
        "completion_tokens": tokens,
    }
