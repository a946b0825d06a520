"""A workflow whose episodes never return, to stall a run on purpose (tests/e2e/test_stall.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from nodes.rollout.workflows import RLVRWorkflow
from protocols.rl import TrajectoryGroup


class NeverReturns(RLVRWorkflow):
    """RLVR's settings; an episode that waits for ever."""

    async def arun_episode(self, client: Any, item: Any, group_id: str | None = None) -> TrajectoryGroup:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")
