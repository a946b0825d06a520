"""An OpenAI Agents SDK (``openai-agents``) agent with a function tool, trained unchanged: ``run``
through the SDK's Responses model (its default), ``run_chat`` through
``OpenAIChatCompletionsModel``. Train it (from the repository's root)::

    PYTHONPATH=. python recipes/gsm8k_grpo.py --config recipes/configs/agent_cpu.toml \\
        rollout.workflow_args.agent=examples.agents.openai_agents_sdk:run

Pointing it at the episode is giving its model the episode's client: ``client`` is an
``openai.AsyncOpenAI`` whose ``base_url`` is the episode's (any model name works). Tracing is off:
the SDK would otherwise export traces to OpenAI's servers.
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    MaxTurnsExceeded,
    Model,
    ModelBehaviorError,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)

from nodes.rollout.reward import final_number_reward

INSTRUCTIONS = "Solve the arithmetic problem. Use the multiply tool, then give the answer in \\boxed{}."
MAX_TURNS = 3


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def calculator(model: Model) -> Agent:
    return Agent(name="calculator", instructions=INSTRUCTIONS, tools=[multiply], model=model)


async def episode(model: Model, item: dict[str, Any]) -> dict[str, float]:
    """One run of the agent; the reward of its final answer. An answer cut at the token limit (the
    Responses model raises ModelBehaviorError on an ``incomplete`` response) or a run out of turns
    scores 0: the episode is still trained on, as a bad answer."""
    try:
        result = await Runner.run(
            calculator(model),
            item["question"],
            max_turns=MAX_TURNS,
            run_config=RunConfig(tracing_disabled=True),
        )
    except (MaxTurnsExceeded, ModelBehaviorError):
        return {"reward": 0.0, "tool_calls": 0}
    calls = sum(i.type == "tool_call_item" for i in result.new_items)
    return {"reward": final_number_reward(str(result.final_output), item), "tool_calls": calls}


async def run(client: Any, item: dict[str, Any]) -> dict[str, float]:
    """Through the Responses API (``/v1/responses``)."""
    return await episode(OpenAIResponsesModel(model="policy", openai_client=client), item)


async def run_chat(client: Any, item: dict[str, Any]) -> dict[str, float]:
    """Through chat completions (``/v1/chat/completions``)."""
    return await episode(OpenAIChatCompletionsModel(model="policy", openai_client=client), item)
