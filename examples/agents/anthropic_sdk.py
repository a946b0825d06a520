"""An agent on the Anthropic SDK's Messages API (``client.messages.create``), trained unchanged.

It asks, runs the ``tool_use`` blocks the model answers with, sends their ``tool_result`` blocks
back with the whole history (as Anthropic's tool-use guide does), until the model answers. Train it
(from the repository's root)::

    PYTHONPATH=. python recipes/gsm8k_grpo.py --config recipes/configs/agent_cpu.toml \\
        rollout.workflow_args.agent=examples.agents.anthropic_sdk:run rollout.workflow_args.sdk=anthropic

With ``sdk = "anthropic"``, ``client`` is an ``anthropic.AsyncAnthropic`` whose ``base_url`` is the
episode's (the endpoint serves ``/v1/messages`` there); any model name works.
"""

from __future__ import annotations

from typing import Any

from nodes.rollout.reward import final_number_reward

SYSTEM = "Solve the arithmetic problem. Use the multiply tool, then give the answer in \\boxed{}."
TOOLS = [
    {
        "name": "multiply",
        "description": "Multiply two integers.",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    }
]
MAX_TURNS = 3
MAX_TOKENS = 256


def multiply(args: dict[str, Any]) -> str:
    """The tool: the product, or an error the model can read."""
    try:
        return str(int(args["a"]) * int(args["b"]))
    except (ValueError, KeyError, TypeError):
        return 'Error: the input must be like {"a": 12, "b": 34}.'


async def run(client: Any, item: dict[str, Any]) -> dict[str, float]:
    """One episode: up to ``MAX_TURNS`` messages, the tool run between them."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": item["question"]}]
    calls = 0
    for _ in range(MAX_TURNS):
        message = await client.messages.create(
            model="policy", max_tokens=MAX_TOKENS, system=SYSTEM, messages=messages, tools=TOOLS
        )
        uses = [b for b in message.content if b.type == "tool_use"]
        if message.stop_reason != "tool_use" or not uses:
            break
        calls += len(uses)
        messages += [
            {"role": "assistant", "content": message.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": b.id, "content": multiply(b.input)} for b in uses
                ],
            },
        ]
    answer = "".join(b.text for b in message.content if b.type == "text")
    return {"reward": final_number_reward(answer, item), "tool_calls": calls}
