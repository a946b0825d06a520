"""An agent with a Python tool, written as any OpenAI-SDK agent is: ask, run the tool calls it
makes, send the results back, until it answers. Trained unchanged by
``[rollout] workflow = "nodes.rollout.agents:AgentWorkflow"`` with
``workflow_args.agent = "recipes.sdk_agents.python_tool:run_guided"`` (recipes/configs/agent_cpu.toml).

Two agents: :func:`run` leaves the call to the model (SmolLM2-135M never makes one: nothing to learn
from, bench/RESULTS.md); :func:`run_guided` shows a worked example and makes the first completion
call a tool, as agents often do, so what is learned is calling it well and using its result.

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


# a worked example, shown as an earlier conversation: ask, call, read the result, answer
EXAMPLE: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 123 * 45?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "python", "arguments": json.dumps({"code": "print(123 * 45)"})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "5535"},
    {"role": "assistant", "content": "123 * 45 = \\boxed{5535}"},
]


async def run(client: Any, item: dict[str, Any]) -> dict[str, float]:
    """One episode: up to ``MAX_TURNS`` completions, the tool run between them; the model decides
    whether to call it."""
    return await _episode(
        client,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item["question"]}],
        item,
        first_choice="auto",
    )


async def run_guided(client: Any, item: dict[str, Any]) -> dict[str, float]:
    """As :func:`run`, with the worked example before the question and the first completion made to
    call a tool (``tool_choice="required"``); after the tool's result the model answers or calls
    again. What the model has to learn is writing a call that runs and computes the product, and
    answering with what it printed (recipes/configs/agent_cpu.toml)."""
    messages = [
        {"role": "system", "content": SYSTEM},
        *EXAMPLE,
        {"role": "user", "content": item["question"]},
    ]
    return await _episode(client, messages, item, first_choice="required")


async def _episode(
    client: Any, messages: list[Any], item: dict[str, Any], first_choice: str
) -> dict[str, float]:
    calls = turns = 0
    answer = ""
    for turn in range(MAX_TURNS):
        turns += 1
        r = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, tool_choice=first_choice if turn == 0 else "auto"
        )
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        answer = msg.content or ""
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            calls += 1
            out = await call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
    return {"reward": final_number_reward(answer, item), "tool_calls": calls, "turns": turns}
