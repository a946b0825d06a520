"""A LangGraph agent (``langgraph`` + ``langchain-openai``): a model node with
``ChatOpenAI(...).bind_tools(...)`` and a tool node, looping until the model answers; trained
unchanged. Train it (from the repository's root)::

    PYTHONPATH=. python recipes/gsm8k_grpo.py --config recipes/configs/agent_cpu.toml \\
        rollout.workflow_args.agent=examples.agents.langgraph_agent:run

Pointing it at the episode: ``ChatOpenAI(base_url=str(client.base_url), model=...)``, ``client``
being the ``openai.AsyncOpenAI`` the workflow gives each run (any model name and API key work).
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from nodes.rollout.reward import final_number_reward

INSTRUCTIONS = "Solve the arithmetic problem. Use the multiply tool, then give the answer in \\boxed{}."
MAX_STEPS = 6  # graph steps: three model calls and the tool runs between them


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def graph(llm: Any) -> Any:
    """model -> tools -> model ... until the model answers without calling a tool."""
    model = llm.bind_tools([multiply])

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("model", call_model)
    g.add_node("tools", ToolNode([multiply]))
    g.add_edge(START, "model")
    g.add_conditional_edges("model", tools_condition)
    g.add_edge("tools", "model")
    return g.compile()


async def run(client: Any, item: dict[str, Any]) -> dict[str, float]:
    """One episode on the episode's base_url."""
    llm = ChatOpenAI(base_url=str(client.base_url), api_key="rlactors", model="policy", max_retries=0)
    messages = [SystemMessage(INSTRUCTIONS), HumanMessage(item["question"])]
    try:
        state = await graph(llm).ainvoke({"messages": messages}, {"recursion_limit": MAX_STEPS})
    except GraphRecursionError:  # out of steps: scored as no answer
        return {"reward": 0.0, "tool_calls": 0}
    answer = state["messages"][-1]
    calls = sum(len(m.tool_calls) for m in state["messages"] if isinstance(m, AIMessage))
    return {"reward": final_number_reward(str(answer.content), item), "tool_calls": calls}
