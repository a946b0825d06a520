"""A tool-call parser for the recipe test: every answer of the random tiny model becomes a call of the
calculator environment's ``multiply`` (what a trained model would write), so the tool really runs in
each episode. ``[rollout.workflow_args] tool_parser = "tests.envs.always_multiply:parse"``."""

from __future__ import annotations

import hashlib

from nodes.rollout.chat import ToolCall


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    call_id = "call_" + hashlib.sha1(text.encode()).hexdigest()[:12]
    return None, [ToolCall(call_id, "multiply", '{"a": 656, "b": 31}')]
