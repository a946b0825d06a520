"""A workflow whose episodes never return once armed, to stall a run on purpose (tests/e2e/test_stall.py)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from nodes.rollout.workflows import RLVRWorkflow
from protocols.rl import TrajectoryGroup

ARMED = "STALL_WORKFLOW_ARMED"  # the environment variable naming the file that arms it


class NeverReturnsOnceArmed(RLVRWorkflow):
    """RLVR's episodes until the file ``$STALL_WORKFLOW_ARMED`` names exists; an episode that
    starts after that waits for ever."""

    async def arun_episode(self, client: Any, item: Any, group_id: str | None = None) -> TrajectoryGroup:
        if await asyncio.to_thread(os.path.exists, os.environ[ARMED]):
            await asyncio.Event().wait()
        return await super().arun_episode(client, item, group_id)
