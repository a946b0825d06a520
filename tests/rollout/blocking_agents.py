"""Agents whose tools block, for tests/rollout/test_agent_runner.py. Light imports: a worker
process of ``agent_runner = "process"`` imports this module."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

INTERVALS: list[tuple[float, float]] = []  # the blocking tool's (start, end), runs in this process


def blocking_tool(seconds: float) -> tuple[float, float]:
    """A sync tool, as agents have: it blocks its thread."""
    start = time.monotonic()
    time.sleep(seconds)
    return start, time.monotonic()


def wait_for_others(folder: Path, runs: int) -> bool:
    """A sync tool that blocks (``time.sleep`` in slices) until ``runs`` runs are in it at once, as
    their files in ``folder`` say, for at most 60 s; whether they were."""
    (folder / f"{os.getpid()}-{time.monotonic_ns()}").write_text(json.dumps(os.getpid()))
    deadline = time.monotonic() + 60
    while len(list(folder.iterdir())) < runs and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(list(folder.iterdir())) >= runs


async def blocking(client: Any, item: dict[str, Any]) -> float:
    """Asks the model, then runs a tool that blocks ``item["block_s"]`` in ``time.sleep``."""
    r = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "go"}])
    INTERVALS.append(blocking_tool(item["block_s"]))
    return float(r.choices[0].message.content == "ok")


async def waiting(client: Any, item: dict[str, Any]) -> float:
    """Asks the model, then blocks until every run of its group is blocking too (1.0 if they were)."""
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "go"}])
    return float(wait_for_others(Path(item["dir"]), item["runs"]))


async def sleeping(client: Any, item: dict[str, Any]) -> float:
    """Blocks past any test's timeout in sync code."""
    blocking_tool(30)
    return 1.0


async def hanging(client: Any, item: Any) -> float:
    """Awaits forever."""
    await asyncio.Event().wait()
    return 1.0
