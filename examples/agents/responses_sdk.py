"""An agent on the OpenAI SDK's Responses API (``client.responses.create``), trained unchanged.

It asks, runs the function calls the model makes, sends their outputs back with
``previous_response_id`` (the episode's endpoint stores each response), until the model answers.
Train it (from the repository's root)::

    PYTHONPATH=. python recipes/gsm8k_grpo.py --config recipes/configs/agent_cpu.toml \\
        rollout.workflow_args.agent=examples.agents.responses_sdk:run

``client`` is an ``openai.AsyncOpenAI`` whose ``base_url`` is the episode's; any model name works.
"""

from __future__ import annotations

import json
from typing import Any

from nodes.rollout.reward import final_number_reward

INSTRUCTIONS = "Solve the arithmetic problem. Use the multiply tool, then give the answer in \\boxed{}."
TOOLS = [
    {
        "type": "function",
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    }
]
MAX_TURNS = 3


def multiply(arguments: str) -> str:
    """The tool: the product, or an error the model can read."""
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) * int(args["b"]))
    except (ValueError, KeyError, TypeError):
        return 'Error: the arguments must be JSON like {"a": 12, "b": 34}.'


async def run(client: Any, item: dict[str, Any]) -> dict[str, float]:
    """One episode: up to ``MAX_TURNS`` responses, the tool run between them."""
    response = await client.responses.create(
        model="policy", instructions=INSTRUCTIONS, input=item["question"], tools=TOOLS
    )
    calls = 0
    for _ in range(MAX_TURNS - 1):
        outputs = [
            {"type": "function_call_output", "call_id": c.call_id, "output": multiply(c.arguments)}
            for c in response.output
            if c.type == "function_call"
        ]
        if not outputs:
            break
        calls += len(outputs)
        response = await client.responses.create(
            model="policy",
            instructions=INSTRUCTIONS,
            input=outputs,
            tools=TOOLS,
            previous_response_id=response.id,
        )
    return {"reward": final_number_reward(response.output_text, item), "tool_calls": calls}
