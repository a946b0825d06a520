"""An agent with a Python tool, written as any OpenAI-SDK agent is: ask, run the tool calls it
makes, send the results back, until it answers. Trained unchanged by
``[rollout] workflow = "nodes.rollout.agents:AgentWorkflow"`` with
``workflow_args.agent = "recipes.agents.python_tool:run"`` (recipes/configs/agent_cpu.toml).

The tool runs the model's code in nodes/rollout/sandbox.py (time and memory limits, no network).
The reward: the final answer (``\\boxed{}``, else its last number) equals the item's answer.
"""

from __future__ import annotations

import json
from typing import Any

from nodes.rollout.reward import final_number_reward
from nodes.rollout.sandbox import run_python

SYSTEM = (
    "You solve arithmetic problems. You can run Python code with the `python` tool: it returns what "
    "the code prints. Compute the result with it, then give the final answer in \\boxed{}."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code and return what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the code, e.g. print(12 * 34)"}},
                "required": ["code"],
            },
        },
    }
]
MAX_TURNS = 3


async def call_tool(name: str, arguments: str) -> str:
    """What the tool answers: the code's output, or an error the model can read."""
    if name != "python":
        return f"Error: there is no tool named {name!r}; use python."
    try:
        code = json.loads(arguments)["code"]
        if not isinstance(code, str):
            raise TypeError(code)
    except (json.JSONDecodeError, KeyError, TypeError):
        return 'Error: the arguments must be JSON like {"code": "print(2 + 2)"}.'
    return (await run_python(code, timeout_s=5.0, memory_mb=256)).as_text() or "(nothing printed)"


async def run(client: Any, item: dict[str, Any]) -> dict[str, float]:
    """One episode: up to ``MAX_TURNS`` completions, the tool run between them."""
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": item["question"]},
    ]
    calls = 0
    answer = ""
    for _ in range(MAX_TURNS):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        answer = msg.content or ""
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            calls += 1
            out = await call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
    turns = sum(1 for m in messages if m["role"] == "assistant")
    return {"reward": final_number_reward(answer, item), "tool_calls": calls, "turns": turns}
