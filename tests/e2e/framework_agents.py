"""One agent that is each framework example of examples/agents/ in turn, for
test_agent_frameworks.py: one recipe run trains them all. The runs on an item take the examples in
turn, so a group of five runs holds one run of each; each run reports which it was as
``episode/<name>`` (1.0). The Anthropic SDK's example is given the client ``sdk = "anthropic"``
would give it, on the same episode."""

from __future__ import annotations

import itertools
import threading
from typing import Any

from examples.agents import anthropic_sdk, langgraph_agent, openai_agents_sdk, responses_sdk
from nodes.rollout.agent_runner import sdk_client


async def on_anthropic(client: Any, item: dict[str, Any]) -> dict[str, float]:
    claude = sdk_client(str(client.base_url).rstrip("/"), "anthropic")
    try:
        return await anthropic_sdk.run(claude, item)
    finally:
        await claude.close()


EXAMPLES = {
    "responses_sdk": responses_sdk.run,
    "openai_agents_responses": openai_agents_sdk.run,
    "openai_agents_chat": openai_agents_sdk.run_chat,
    "langgraph": langgraph_agent.run,
    "anthropic_sdk": on_anthropic,
}
_turns: dict[str, itertools.count] = {}  # per item; next() is atomic: runs in threads take turns safely
_lock = threading.Lock()


async def run(client: Any, item: dict[str, Any]) -> dict[str, float]:
    with _lock:
        turns = _turns.setdefault(item["question"], itertools.count())
    name = list(EXAMPLES)[next(turns) % len(EXAMPLES)]
    return {**await EXAMPLES[name](client, item), name: 1.0}
